"""`kvscope report`: traces, benchmarks/race JSON and diagnose JSON as one self-contained HTML page.

- ``series``: one pass over a trace into fixed-size, downsampled series (extremes kept);
- ``inputs``: what each input file is, refused in one line when it is none of them;
- ``plots``: the figures, drawn with matplotlib as static SVG;
- ``page``: the HTML around them, with nothing fetched when it opens.
"""
