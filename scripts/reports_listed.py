"""Is every committed evidence folder in git, listed, and is reports/ small? Run by CI.

    python3 scripts/reports_listed.py [ROOT]

The folders reports/README.md's table lists (`| \\`name/\\`` or `| \\`name/file\\``) must be
exactly the folders under reports/ that git tracks (a .gitignore that hides one leaves every
clone without it; a folder nobody lists backs no claim), and the tracked files under reports/
must hold at most 10 MB. Exit status 1, naming what is wrong; 0 with one line otherwise.
"""
import re
import subprocess
import sys
from pathlib import Path

LIMIT = 10_000_000


def main(root: Path) -> int:
    tracked = subprocess.run(["git", "ls-files", "reports"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    readme = (root / "reports" / "README.md").read_text()
    listed = {m.split("/")[0] for m in re.findall(r"^\| `([\w./-]+)`", readme, re.M)
              if "/" in m}
    committed = {path.split("/")[1] for path in tracked if path.count("/") >= 2}
    problems = []
    if listed - committed:
        problems.append(f"listed in reports/README.md, not in git: {sorted(listed - committed)} "
                        "(a .gitignore rule hiding them?)")
    if committed - listed:
        problems.append(f"in git, not listed in reports/README.md: {sorted(committed - listed)}")
    size = sum((root / p).stat().st_size for p in tracked if (root / p).exists())
    if size > LIMIT:
        problems.append(f"reports/ holds {size / 1e6:.1f} MB, more than {LIMIT / 1e6:.0f} MB")
    for line in problems:
        print(f"reports_listed: {line}", file=sys.stderr)
    if not problems:
        print(f"reports/: {len(committed)} folders, each listed and in git, {size / 1e6:.1f} MB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent))
