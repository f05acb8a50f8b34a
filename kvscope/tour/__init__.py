"""`kvscope tour`: a guided, live walk through the lesson, one idea per chapter.

    script.py    the data a chapter is made of: scenes, arrivals, the moment a cue returns
    cues.py      what each chapter waits for, read from the dashboard's own reduced state
    chapters.py  the eight chapters: settings, scripted requests, captions, cues
    driver.py    runs one engine per scene on a thread; freezes the world at each cue
    run.py       the driver and the dashboard together (the `kvscope tour` command)

A cue is engine state (a preemption happened, a block is shared four ways), never wall time,
and arrivals are keyed to engine steps, so a chapter plays the same on a fast machine, a slow
one and the sim. The driver imports the engine; the screens (kvscope.tui.launch.tour) see events
and a status object only.
"""
