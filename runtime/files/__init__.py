"""Writing files and folders so that a reader never sees half of one, and nothing edgelin did not write
is ever replaced. Standard library only.

- ``atomic_write``: one file, through a temporary file beside it and a rename. Every file edgelin writes
  goes through it, and through ``check_replace``: an existing file is replaced only if edgelin wrote it
  (recognised by its content: a JSON's ``format`` key, a state file's header, ...) and it is not part of an
  export -- otherwise only with ``overwrite=True`` (``--force``). Never a folder, a symbolic link, a FIFO
  or a device.
- ``check_output_file`` / ``check_output_dir``: every output path is checked before any work starts.
- ``replace_dir``: move a finished folder into place, replacing only what ``check_output_dir`` allowed.
- ``remove_stale_temps``: the hidden ``.NAME.tmp.PID.*`` / ``.NAME.old.PID.*`` folders an export or a site killed
  by SIGKILL leaves behind are removed by the next one to the same place: only folders that hold edgelin's work
  marker (``WORK_MARKER``, naming the folder itself, whose name holds the id of the process that made it), only
  when that process is gone, and only when they hold nothing but what edgelin writes there. A folder of the same name that lacks the
  marker is the user's, and is left alone.

One module per part: ``reading`` (regular files of a bounded size), ``replace`` (may an existing file be replaced,
the recognisers), ``atomic`` (one file, and JSON), ``paths`` (a path given through the API, output paths checked
before any work), ``folders`` (output folders: checked, built beside, moved into place, stale ones removed) and
``failures`` (why a write failed, cleanup a second Ctrl-C does not cut short). Import from this package.
"""

from __future__ import annotations

from edgelin.runtime.files.atomic import atomic_write, json_ready, write_json
from edgelin.runtime.files.failures import uninterrupted, write_failure
from edgelin.runtime.files.folders import (
    WORK_MARKER, check_output_dir, export_files, file_sha256, make_parents, remove_created, remove_stale_temps, replace_dir, temp_dir,
    work_dir, work_files,
)
from edgelin.runtime.files.paths import check_output_file, check_output_folder, check_path, nearest_existing
from edgelin.runtime.files.reading import read_regular, regular_file
from edgelin.runtime.files.replace import MANIFEST_FILE, MAX_RECOGNISED_BYTES, check_replace, export_holding, json_format, png_text

__all__ = [
    "MANIFEST_FILE", "MAX_RECOGNISED_BYTES", "WORK_MARKER", "atomic_write", "check_output_dir", "check_output_file", "check_output_folder",
    "check_path", "check_replace", "export_files", "export_holding", "file_sha256", "json_format", "json_ready", "make_parents",
    "nearest_existing", "png_text", "read_regular", "regular_file", "remove_created", "remove_stale_temps", "replace_dir", "temp_dir",
    "uninterrupted", "work_dir", "work_files", "write_failure", "write_json",
]
