"""The training command of the data-parallel tests: the tiny profile's flags, one process or torchrun ranks."""

from __future__ import annotations

N_FIT = 8


SETTINGS = [
    "--updates",
    "4",
    "--batch",
    "4",
    "--n-fit",
    str(N_FIT),
    "--checkpoint-every",
    "2",
    "--val-every",
    "2",
    "--lr",
    "3e-3",
    "--fit-weighting",
    "attention",
    "--family",
    "headwise",
    "--ridge",
    "0",
]  # plain least squares, as below


def cli(paths, data_dir, root, run, *extra) -> list[str]:
    return [
        "--profile",
        "tiny",
        "--data",
        str(data_dir),
        "--run",
        run,
        "--large",
        str(paths[0]),
        "--small",
        str(paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--artifacts",
        str(root / "artifacts"),
        "--results",
        str(root / "results"),
        *SETTINGS,
        *extra,
    ]


def main(argv):
    import train_translator

    return train_translator.main(argv)
