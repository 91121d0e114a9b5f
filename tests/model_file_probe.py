"""Child process of tests/test_model_files.py: uses each model file given, as a user would, and
reports on stdout how each use ended. A crash ends the process; the parent reads which file was
begun last.

    python tests/model_file_probe.py FILE...     one JSON line per file: {"file", "outcome"}
"""

from __future__ import annotations

import json
import sys

import numpy as np

import retro


def use(path: str, trainable: bool) -> None:
    with retro.Model.load(path, devices=[], trainable=trainable) as m:
        m.detokenize(m.tokenize("hello world, hello"))
        m.detokenize(list(range(m.n_vocab)), render_special=True)
        m.tensor_names()
        n_ctx = 64
        with retro.Context(m, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx) as c:
            c.decode([t % m.n_vocab for t in range(8)])
            c.generate([1, 2], 4)
            if trainable:
                c.reset()
                stream = np.arange(2 * n_ctx + 1) % m.n_vocab
                retro.Trainer(c).epoch(retro.TokenDataset.from_tokens(stream, width=n_ctx), val_fraction=0.0)


def outcome(path: str, trainable: bool) -> str:
    try:
        use(path, trainable)
    except retro.RetroError as e:
        return f"typed {type(e).__name__}"
    except Exception as e:  # noqa: BLE001 - anything else is a finding, reported with its message
        return f"untyped {type(e).__name__}: {e}"
    return "ok"


def main(paths: list[str]) -> None:
    for i, path in enumerate(paths):
        print(json.dumps({"begin": i}), flush=True)
        print(json.dumps({"file": i, "outcome": outcome(path, trainable=i % 2 == 0)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
