"""Child-process probe behind ``kvstore doctor``: which NIXL backend plugins load.

Run as ``python -m kvstore.net.nixl.probe``; prints one JSON object. Kept out of
the doctor's own process because plugins load native libraries that may abort.
"""

from __future__ import annotations

import json
import logging
import os
import uuid


_HINTS = {
    "OBJ": "object-storage backend: needs bucket and endpoint parameters",
    "AZURE_BLOB": "Azure Blob backend: needs a storage account and container",
    "GUSLI": "GUSLI block-device backend: needs a GUSLI config file and devices",
}


def probe() -> dict:
    from kvstore.net.nixl.env import prepare_ucx_env

    prepare_ucx_env()
    try:
        import nixl
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:
        return {"import_error": f"{type(exc).__name__}: {exc}"}
    logging.getLogger("nixl").setLevel(logging.CRITICAL)  # per-plugin tracebacks are expected here
    version = getattr(nixl, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        try:
            version = dist_version("nixl")
        except PackageNotFoundError:
            version = "?"
    try:
        agent = nixl_agent(f"kvstore-doctor-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                           nixl_agent_config(enable_prog_thread=False, backends=[]))
    except Exception as exc:
        return {"import_error": f"cannot create a NIXL agent: {exc}"}
    backends = {}
    for name in agent.get_plugin_list():
        try:
            mem_types = agent.get_plugin_mem_types(name)
        except Exception:
            mem_types = []
        if not mem_types:
            backends[name] = {"ok": False, "reason": "plugin does not load (its native dependencies, "
                              "e.g. CUDA, cuFile, libfabric or a vendor SDK, are missing)"}
            continue
        try:
            agent.create_backend(name, {})
        except Exception as exc:
            backends[name] = {"ok": False, "reason": _HINTS.get(name, "plugin loads but the backend does not "
                              "start with default parameters") + f" ({type(exc).__name__}: {exc})"}
            continue
        backends[name] = {"ok": True, "mem_types": [m.removesuffix("_SEG") for m in mem_types]}
    return {"version": version, "backends": backends}


if __name__ == "__main__":
    # a newline first: some plugins print to stdout without ending their line
    print("\n" + json.dumps(probe()), flush=True)
