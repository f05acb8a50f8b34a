"""The one C++ library of CPU kernels (csrc/): built once per machine, loaded, and the Python faces of its ops."""
