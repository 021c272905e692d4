"""How the studies read and write files: an output of a study names the file it was computed from by
that file's sha256, so that a study never combines files of two runs of one checkpoint; a figure is
written whole or not at all, as every result is (model.save_atomic)."""
import io

from configurator import UserError
from model import save_atomic
from prepare import sha256_of


def check_source(output, output_path, source_path, key):
    """UserError unless output (read from output_path) was computed from the file at source_path,
    whose sha256 it keeps under key."""
    if output.get(key) != sha256_of(source_path):
        raise UserError(f"{output_path} was computed from another {source_path} than the one there "
                        f"(a run since?): compute it again")


def save_figure(fig, path, dpi=120):
    """fig as a PNG at path, whole or not at all: a failed redraw keeps the previous figure."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    save_atomic(path, png.getvalue())
