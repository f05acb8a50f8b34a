"""An SVG screenshot of the tour at every moment it freezes, and the time each took to reach.

    python -m kvscope.tour.screenshots OUTDIR [--sim] [--step-ms MS]

Drives the real tour headless (Textual's Pilot), pressing → as soon as each moment is on screen,
and writes OUTDIR/KEY[-BEAT].svg. Prints one line per moment: seconds since start, and the cue's line.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

SIZE = (120, 40)


async def shoot(outdir: str, options) -> float:
    from kvscope.tour.driver import FROZEN, THE_END
    from kvscope.tour.run import make_tour_app

    app, driver = make_tour_app(options)
    t0 = time.monotonic()
    async with app.run_test(size=SIZE) as pilot:
        while True:
            st = driver.status
            drawn = app.screen.shown_serial == st.serial
            if st.phase == THE_END or st.phase == "error":
                break
            if st.phase != FROZEN or not drawn or driver._out.events:
                await pilot.pause(0.05)
                continue
            await pilot.pause()
            beat = sum(1 for k, _, _ in driver.moments if k == st.scene_key) - 1
            name = st.scene_key + (f"-{beat + 1}" if beat else "")
            app.save_screenshot(f"{name}.svg", path=outdir)
            print(f"{time.monotonic() - t0:6.1f} s  {name}: {st.said}", flush=True)
            await pilot.press("right")
            await pilot.pause(0.05)
        await pilot.press("q")
    if driver.error:
        raise SystemExit(f"kvscope tour: error: {driver.error}")
    return time.monotonic() - t0


def main() -> None:
    from kvscope.tour.driver import TourOptions

    # a developer script (the docs' screenshots), so a plain argv: OUTDIR [--sim] [--step-ms MS]
    args = sys.argv[1:]
    sim = "--sim" in args
    step_ms = float(args[args.index("--step-ms") + 1]) if "--step-ms" in args else 0.0
    outdir = next((a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--step-ms")),
                  None)
    if outdir is None:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    os.makedirs(outdir, exist_ok=True)
    options = TourOptions(sim_gpu="h100-sxm5" if sim else None, step_ms=step_ms, device="auto" if sim else "cpu")
    total = asyncio.run(shoot(outdir, options))
    print(f"{total:6.1f} s  the whole tour")


if __name__ == "__main__":
    main()
