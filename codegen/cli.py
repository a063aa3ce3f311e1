"""``regenerate-kernels``: rewrite generated/ from the registry and rebuild in place;
``--check`` exits 1 with a diff when generated/ is stale."""
from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import time
from pathlib import Path

from .generate import render_all, write

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"


def stale(files: dict[str, str], folder: Path) -> list[str]:
    """Unified diffs between ``files`` and ``folder`` (missing and extra files included)."""
    diffs = []
    present = {p.name for p in folder.glob("*") if p.suffix in (".pyx", ".json") or p.name == "__init__.py"}
    for name in sorted(set(files) | present):
        old = (folder / name).read_text() if name in present else ""
        new = files.get(name, "")
        if old != new:
            diffs.append("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                      f"generated/{name}", f"regenerated/{name}", n=1)))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="regenerate-kernels", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 with a diff if stale")
    parser.add_argument("--no-build", action="store_true", help="write the files but do not compile")
    parser.add_argument("--out", type=Path, default=GENERATED, help="target folder (default: generated/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    files = render_all()
    print(f"generated {len(files)} files ({sum(map(len, files.values())) / 1e3:.0f} kB) "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if args.check:
        diffs = stale(files, args.out)
        if diffs:
            sys.stdout.write("".join(d[:20000] for d in diffs))
            print(f"generated/ is stale: {len(diffs)} file(s) differ; run `regenerate-kernels`",
                  file=sys.stderr)
            return 1
        print("generated/ is up to date", file=sys.stderr)
        return 0
    for name in set(p.name for p in args.out.glob("*.pyx")) - set(files):
        (args.out / name).unlink()
    write(files, args.out)
    if not args.no_build and args.out == GENERATED:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
