"""Runs the chosen experiments, then writes their raw numbers, figures and docs/experiments.md.

Each experiment's numbers go to their own JSON beside its figure, and the document is rebuilt
from every JSON there, so running one experiment alone (`--only`) refreshes its section and
keeps the others as they were last measured (each section names its own date and command).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

from quill.bench.experiments import batching, cost, interference, load, reading, routing, split
from quill.bench.experiments.context import Context, Settings, machine_info
from quill.bench.experiments.figures import PLOTS
from quill.bench.experiments.report import Section, pct, render_report, shown_path
from quill.bench.experiments.stats import median, relative_error

# In the order they run and appear; split, load and routing last: they free the shared engine
# for their servers.
EXPERIMENTS: dict[str, ModuleType] = {
    m.NAME: m for m in (reading, batching, cost, interference, split, load, routing)
}


def default_root() -> Path:
    """The repository this package sits in (where docs/ lives), else the working directory."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def run_experiments(
    settings: Settings, names: list[str], doc: Path, out_dir: Path, command: str
) -> int:
    """Run `names` in order; 0 if every one succeeded, 1 if any failed (the others still
    run, and the document is rebuilt from whatever numbers exist)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(settings, out_dir)
    ctx.plan([n for n in (EXPERIMENTS[name].needs(ctx) for name in names) if n is not None])
    started = time.perf_counter()
    _ = ctx.hardware  # find or measure the calibration first, so every experiment shares it
    machine = machine_info()
    failed = []
    for name in names:
        module = EXPERIMENTS[name]
        ctx.log(f"experiment {name}: {module.TITLE}")
        t0 = time.perf_counter()
        try:
            result = module.run(ctx)
        except Exception:  # one broken experiment must not cost the others' numbers
            ctx.log(traceback.format_exc())
            failed.append(name)
            continue
        meta = {
            "name": name,
            "date": _now(),
            "command": command,
            "quick": settings.quick,
            "seconds": time.perf_counter() - t0,
            "machine": machine,
            "calibration": ctx.calibration,
            "settings": vars(settings),
        }
        (out_dir / f"{name}.json").write_text(
            json.dumps({"meta": meta, "result": result}, indent=1, default=str) + "\n"
        )
        PLOTS[name](result, out_dir / f"{name}.png")
        ctx.log(f"experiment {name}: done in {meta['seconds']:.0f} s")
    ctx.release_engine()
    header = {
        "date": _now(),
        "command": command,
        "quick": settings.quick,
        "machine": machine,
        "calibration": ctx.calibration,
        "model": ctx.model.name,
        "notes": _notes(ctx, time.perf_counter() - started, names, failed),
    }
    write_report(header, doc, out_dir)
    ctx.log(f"wrote {doc} and {out_dir}/ in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


def _notes(ctx: Context, seconds: float, names: list[str], failed: list[str]) -> list[str]:
    notes = [f"This run took {seconds / 60:.1f} minutes."]
    if ctx.calibration.get("seconds") is not None:
        saved = shown_path(ctx.calibration["path"])
        notes.append(
            f"No calibration was used from disk: a quick one was measured first "
            f"({ctx.calibration['seconds']:.0f} s) and saved to `{saved}`."
        )
    ran = {k: v for k, v in load_results(ctx.out_dir).items() if k in names}
    check = None if ctx.calibration.get("seconds") is not None else calibration_check(ran)
    if check:
        notes.append(check)
    if failed:
        notes.append(f"Failed in this run (their sections are older or missing): {failed}.")
    return notes


def calibration_check(stored: dict[str, dict]) -> str | None:
    """A warning when the calibration misprices this run's plain decode steps (batch 1 at
    every context, and every batch at one context) by more than 15% at the median: a sign
    that it was measured before the engine last changed speed."""
    pairs = []
    if "reading" in stored:
        pairs += [
            (s["predicted_s"], s["measured_s"]) for s in stored["reading"]["result"]["decode_steps"]
        ]
    if "batching" in stored:
        pairs += [(r["predicted_s"], r["measured_s"]) for r in stored["batching"]["result"]["rows"]]
    errors = sorted(relative_error(p, m) for p, m in pairs if m)
    if not errors:
        return None
    middle = median(errors)
    if abs(middle) <= 0.15:
        return None
    return (
        f"The calibration prices the {len(errors)} plain decode steps measured in experiments "
        f"1 and 2 {pct(abs(middle), False)} too {'slow' if middle > 0 else 'fast'} at the "
        "median: it may have been measured before the engine last changed speed. "
        "`--recalibrate` measures a fresh one (quick) for the predictions."
    )


def load_results(out_dir: Path) -> dict[str, dict]:
    """Every experiment's stored {"meta", "result"} found in `out_dir`, by name."""
    found = {}
    for name in EXPERIMENTS:
        path = out_dir / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def write_report(header: dict, doc: Path, out_dir: Path) -> None:
    sections = []
    for name, stored in load_results(out_dir).items():
        module = EXPERIMENTS[name]
        try:
            section = module.describe(stored["result"])
        except (KeyError, TypeError, IndexError):  # numbers stored by an older version
            section = Section(
                name,
                module.TITLE,
                f"The stored numbers (`{name}.json`) are in a format this version no longer "
                f"reads: run `quill bench experiments --only {name}` to measure them again.",
            )
        sections.append((section, stored["meta"]))
    figures = Path(os.path.relpath(out_dir, doc.parent)).as_posix()
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render_report(header, sections, figures))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
