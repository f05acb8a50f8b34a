"""Running the model well on a CPU: packed linear layers, the C++ decode loop, dtype and thread choices, memory."""
