"""LoRA adapters over HTTP: ``/load_lora_adapter`` and ``/unload_lora_adapter`` (admin routes), the adapters
``/v1/models`` lists, and the adapter an OpenAI ``model`` names (``"<served-name>:<adapter>"``).

Which adapters exist is the scheduler's to know (they change at run time, on every data-parallel replica): the
HTTP process asks it (``ControlReq`` kinds ``lora_adapters``, ``load_lora_adapter``, ``unload_lora_adapter``) and
an unknown adapter in a request is refused by the scheduler's validation with a 400 naming the loaded ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from treadle.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from treadle.server.tokenizer_manager import RequestError, TokenizerManager

# An unload waits for the adapter's running requests; this long at most.
UNLOAD_TIMEOUT_S = 600.0


def add_lora_routes(app: FastAPI, manager: TokenizerManager) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> JSONResponse:
        check_allowed_folder(manager, body.lora_path)
        result = await manager.control("load_lora_adapter", timeout=120.0,
                                       args={"lora_name": body.lora_name, "lora_path": body.lora_path})
        if "error" in result:
            raise RequestError(result["error"], param="lora_path")
        return JSONResponse({"success": True, "lora_name": body.lora_name})

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> JSONResponse:
        result = await manager.control("unload_lora_adapter", timeout=UNLOAD_TIMEOUT_S,
                                       args={"lora_name": body.lora_name})
        if "error" in result:
            raise RequestError(result["error"], param="lora_name")
        return JSONResponse({"success": True, "lora_name": body.lora_name})


def check_allowed_folder(manager: TokenizerManager, folder: str) -> None:
    """Refuse (403) a folder outside ``lora.allowed_dirs`` that is not one of ``lora.paths``."""
    lora = manager.config.lora
    target = Path(folder).resolve()
    if any(target == Path(path).resolve() for path in lora.paths.values()):
        return
    if any(target.is_relative_to(Path(allowed).resolve()) for allowed in lora.allowed_dirs):
        return
    allowed = ", ".join(lora.allowed_dirs) or "none: set lora.allowed_dirs to allow loading at run time"
    raise RequestError(f"LoRA adapter folder {folder} is outside the allowed folders ({allowed})",
                       param="lora_path", status_code=403, type_="permission_error")


async def adapter_cards(manager: TokenizerManager) -> list[dict[str, Any]]:
    """A ``/v1/models`` card per loaded adapter, named ``<served-name>:<adapter>``."""
    if not manager.config.lora.requested:
        return []
    adapters = (await manager.control("lora_adapters")).get("adapters", [])
    served = manager.served_model_name
    return [{"id": f"{served}:{adapter['name']}", "object": "model", "created": 0, "owned_by": "treadle",
             "root": adapter["path"], "parent": served, "max_model_len": manager.context_len}
            for adapter in adapters]


def model_adapter(manager: TokenizerManager, model: str | None) -> str | None:
    """The adapter an OpenAI ``model`` names (``"<served-name>:<adapter>"``), or None for the base model (404
    for a model this server does not serve)."""
    accepted = {manager.served_model_name, str(manager.model_info.get("model_path"))}
    if model is None or model in accepted:
        return None
    base, sep, adapter = model.rpartition(":")
    if sep and base in accepted and adapter and manager.config.lora.requested:
        return adapter
    raise RequestError(f"the model '{model}' does not exist; this server serves '{manager.served_model_name}'"
                       + (" and its LoRA adapters as '<model>:<adapter>'" if manager.config.lora.requested else ""),
                       param="model", status_code=404, code="model_not_found")
