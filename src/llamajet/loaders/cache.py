"""The repacked-weights cache (``RuntimeConfig.weight_cache``): a GGUF's
matrices in the packed kernels' layout, saved once, mapped as is afterwards.

Every load of a GGUF repacks its block matrices into their packed twins
(formats/pending.py): ~1 s per GB here, the whole load of an 8B Q4_K_M
(8.9 s) but for the tokenizer. With a cache directory, the first load writes
the twins as a saved llamajet model (formats/saved.py: the same folder
``llamajet quantize --scheme keep`` writes, tokenizer files included) under
``<dir>/<file stem>-<key>``, and every later load of that file maps it: no
repack, the weights' pages are the cache file's (shared by every process
that maps it, as llama.cpp shares a GGUF it maps as is).

The key is a hash of the GGUF's resolved path, size and modification time
and of the saved format's version, so a changed or replaced file gets a new
entry (stale ones are left for the user to delete; `llamajet info` names the
entry in use). An entry is published by one rename after its llamajet.json
is written: a reader sees a whole entry or none, and two processes filling
the same entry at once each write their own and one rename wins.

Only files whose every matrix the packed kernels run as it is (GGUF types
with a lossless twin: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are
cached; anything else (a float or a Q2_K / IQ* matrix, which the loader
converts) loads from the GGUF as always, and `cacheable` says why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from llamajet.formats import saved
from llamajet.formats.gguf_blocks import LOSSLESS
from llamajet.loaders.base import LoadedModel, page_releaser


def entry_path(root: str | Path, gguf: str | Path) -> Path:
    """Where the cache entry of GGUF file `gguf` lives under `root`."""
    p = Path(gguf).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{saved.FORMAT_VERSION}".encode()).hexdigest()[:16]
    return Path(root) / f"{p.stem}-{key}"


def cacheable(model: LoadedModel) -> str | None:
    """None when every weight of GGUF model `model` is kept as the kernels
    run it; else why the cache is not used for it."""
    for w in model.weights.values():
        if w.kind.quantizable and not w.packed and w.dtype not in LOSSLESS:
            return f"{w.name} is {w.dtype}, which the loader converts (not a packed twin)"
    return None


def write_entry(model: LoadedModel, tokenizer, dest: Path) -> Path:
    """`model` (a loaded GGUF) saved as cache entry `dest`: weights repacked
    one tensor at a time (each source's file pages dropped after it), the
    tokenizer's files, llamajet.json last; then renamed into place."""
    from llamajet.tokenizer.export import check_written, write_tokenizer_files

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        release = page_releaser(model)
        plans = [saved.kept(w, release)[0] for w in model.weights.values()]
        _, entries = saved.write_weights(tmp, saved.fused(model.config, plans))
        src = Path(model.source)
        write_tokenizer_files(tokenizer, src, tmp, model.config.max_position_embeddings)
        check_written(tokenizer, tmp)
        saved.write_meta(tmp, model.config, entries, scheme="keep", source=src.name, cache_of=str(src.resolve()))
        try:
            os.rename(tmp, dest)
        except OSError:  # another process published the entry first: use theirs
            if not (dest / saved.META_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def lookup(root: str | Path, gguf: str | Path) -> Path | None:
    """The complete cache entry of `gguf` under `root`, or None."""
    d = entry_path(root, gguf)
    return d if (d / saved.META_FILE).is_file() else None
