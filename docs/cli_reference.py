"""Writes docs/cli.md, the command line's reference, from the absl flag definitions themselves:
every flag of ``hetpipe-train`` and ``hetpipe`` with its type, default and help, after each
command's own synopsis. ``make docs`` runs it before building the site, so the reference cannot
drift from the flags.

    python docs/cli_reference.py [OUTPUT]      # default: docs/cli.md
"""
import json
import os
import subprocess
import sys

COMMANDS = (("hetpipe-train", "hetpipe_tf.cli.train"), ("hetpipe", "hetpipe_tf.cli.hetpipe"))
# Run in a process of its own per command: each module defines its flags on absl's global FLAGS.
_DUMP = """
import importlib, json, sys
from absl import flags
module = importlib.import_module(sys.argv[1])
rows = []
for owner, defined in flags.FLAGS.flags_by_module_dict().items():
    if owner.startswith("hetpipe_tf."):
        for f in defined:
            rows.append({"name": f.name, "type": f.flag_type(), "default": f.default_as_str,
                         "help": f.help})
print(json.dumps({"doc": module.__doc__, "flags": sorted(rows, key=lambda r: r["name"])}))
"""


def command_reference(module):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", _DUMP, module], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown():
    lines = ["# Command line reference", "",
             "Every flag of the two commands, generated from their definitions by `docs/cli_reference.py` at",
             "`make docs` (so it is never stale). Each command also prints this with `--helpfull`.", ""]
    for command, module in COMMANDS:
        ref = command_reference(module)
        lines += [f"## `{command}`", "", "```text", ref["doc"].strip(), "```", "",
                  "| flag | type | default | what it does |", "|---|---|---|---|"]
        for f in ref["flags"]:
            default = f["default"].strip("'\"") if f["default"] not in (None, "None") else ""
            lines.append(f"| `--{f['name']}` | {f['type']} | {_cell(default) and f'`{_cell(default)}`'} | "
                         f"{_cell(f['help'])} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    output = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli.md")
    with open(output, "w") as f:
        f.write(markdown())
    print(f"written to {output}")
