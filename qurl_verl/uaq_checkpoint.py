"""Apply UAQ to the actor's checkpoint once, in the driver, so `+qurl=int8` needs no manual step.

UAQ re-parametrises the *trained* weights (RMSNorm × s, q/k/v ÷ s) before step 1; the optimizer
then works in the scaled space and every later step only re-quantizes. The driver converts the
checkpoint named by `actor_rollout_ref.model.path` into a cached copy and points the actor there.
A checkpoint that already carries the UAQ record (a resumed or exported run) is used as it is, so
weights are never scaled twice. The copy is written to a temporary folder and renamed when
complete: an interrupted conversion leaves nothing that a later run would mistake for a result.

On several nodes, put `qurl.uaq.cache_dir` on storage every node can read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from qurl_verl.quant.uaq import CONFIG_KEY, DEFAULT_UAQ_SCALE, DEFAULT_UAQ_TARGETS

DEFAULT_CACHE = Path(os.environ.get("QURL_CACHE_DIR", Path.home() / ".cache" / "qurl_verl")) / "uaq"


def uaq_record_of(model_dir: str | Path) -> dict | None:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get(CONFIG_KEY)


def _fingerprint(model_dir: Path, scale: float, targets: list[str]) -> str:
    """Cheap identity of a checkpoint folder: file names, sizes and mtimes, plus the UAQ settings."""
    h = hashlib.sha256(json.dumps({"scale": scale, "targets": sorted(targets)}).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update((model_dir / "config.json").read_bytes())
    return h.hexdigest()[:16]


def ensure_uaq_checkpoint(model_dir: str | Path, scale: float = DEFAULT_UAQ_SCALE, targets=DEFAULT_UAQ_TARGETS,
                          cache_dir: str | Path | None = None, log=print) -> Path:
    """Return a checkpoint folder with UAQ applied: `model_dir` itself if it already has it, else a cached copy."""
    from qurl_verl.quant.uaq_convert import convert_checkpoint

    src = Path(model_dir).expanduser().resolve()
    targets = list(targets)
    existing = uaq_record_of(src)
    if existing is not None:
        if abs(float(existing.get("scale", 0)) - scale) > 1e-12:
            raise ValueError(
                f"{src} already carries UAQ with scale {existing.get('scale')}, but qurl.uaq.scale={scale}: "
                "UAQ is applied once; set qurl.uaq.scale to the checkpoint's value or qurl.uaq.enable=false"
            )
        have = sorted(existing.get("targets") or [])
        if have != sorted(targets):
            raise ValueError(
                f"{src} already carries UAQ on {have}, but qurl.uaq.targets={sorted(targets)}: UAQ is applied "
                "once; set qurl.uaq.targets to the checkpoint's value or qurl.uaq.enable=false"
            )
        log(f"[qurl] UAQ already applied to {src} ({existing}); using it as is")
        return src
    cache = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE
    dest = cache / f"{src.name}-uaq{scale:g}-{_fingerprint(src, scale, targets)}"
    if (dest / "config.json").exists() and uaq_record_of(dest) is not None:
        log(f"[qurl] UAQ checkpoint cache hit: {dest}")
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        convert_checkpoint(src, tmp, scale=scale, targets=targets, progress=lambda line: log(f"[qurl] UAQ: {line}"))
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"[qurl] UAQ (s={scale:g}, {'/'.join(targets)}) applied to {src} -> {dest} in {time.perf_counter() - t0:.1f} s")
    return dest
