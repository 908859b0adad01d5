"""Print one of the README's shell commands, so that CI runs exactly what a newcomer copies.

README.md marks each command CI runs with an HTML comment (invisible when rendered) right before its fenced block:

    <!-- ci: install -->
    ```bash
    pip install torch==2.13.0 && pip install -e ".[dev]"
    ```

Usage: python .ci/readme_commands.py NAME   (prints the one-line command of the block marked NAME)
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_command(name: str, text: str | None = None) -> str:
    """The one-line command in the ```bash block that follows `<!-- ci: NAME -->` in the README.

    Raises:
        SystemExit: no such marker, no bash block right after it, or a block of more than one line.
    """
    text = README.read_text() if text is None else text
    match = re.search(rf"<!-- ci: {re.escape(name)} -->\n```bash\n(.*?)\n```", text, flags=re.DOTALL)
    if match is None:
        raise SystemExit(f"README.md has no ```bash block right after <!-- ci: {name} -->")
    lines = match.group(1).strip().splitlines()
    if len(lines) != 1:
        raise SystemExit(f"README.md's block <!-- ci: {name} --> must hold one command line, found {len(lines)}")
    return lines[0]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(readme_command(sys.argv[1]))
