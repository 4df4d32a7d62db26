"""The scaled run of a service-mode job (spec.service): the trainer's and samplers' processes started as
for the RL loop, until the Tinker API answers on the trainer's port, then a training client's device
operations through the API as the SDK sends them (create_model, optim_step, save_state,
save_weights_for_sampler), every process of the trainer still running afterwards."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

from rljob.common.ports import free_port

from .cases import DrillFailed, jobset_of
from .procs import Proc, launch, local_run_config, start_storage, stop


def rehearse_service(base: str, key: str, rc: Any, timeout: float) -> dict[str, Any]:
    """A training client's device operations through the API at ``base`` (with the run's key), as the SDK
    sends them: create_model (a new adapter and its automatic checkpoint), optim_step (the Adam program and
    a checkpoint), save_state (orbax) and save_weights_for_sampler (the adapter gathered whole for the PEFT
    export). On a trainer of several processes each is run by every process (rljob.trainer.tinker.
    collective). Returns what each answered; DrillFailed on a failed one."""
    from rljob.common.http import NO_RETRY, shared
    from tinker import types

    http, headers = shared(), {"X-API-Key": key}

    def post(route: str, body: Any) -> Any:
        return http.post_json(
            f"{base}/{route}", body.model_dump(mode="json"), headers=headers, timeout=60, retry=NO_RETRY
        )

    def result(route: str, body: Any) -> Any:
        rid = post(route, body)["request_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = post("retrieve_future", types.FutureRetrieveRequest(request_id=rid))
            if out.get("type") != "try_again":
                if "error" in out:
                    raise DrillFailed(f"the API's {route} failed: {out['error']}")
                return out
        raise DrillFailed(f"the API's {route} did not finish in {timeout:.0f} s")

    t0 = time.monotonic()
    sid = post("create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="drill"))
    lora = types.LoraConfig(rank=int(rc.spec.lora.rank), seed=0)
    created = result(
        "create_model",
        types.CreateModelRequest(
            session_id=sid["session_id"], model_seq_id=0, base_model=rc.spec.model.name, lora_config=lora
        ),
    )
    mid = created["model_id"]
    step = result(
        "optim_step",
        types.OptimStepRequest(model_id=mid, seq_id=1, optim_params=types.AdamParams(learning_rate=1e-3)),
    )
    state = result("save_weights", types.SaveWeightsRequest(model_id=mid, seq_id=2, path="drill"))
    sampler = result(
        "save_weights_for_sampler", types.SaveWeightsForSamplerRequest(model_id=mid, seq_id=3, path="drill")
    )
    return {
        "model_id": mid,
        "optim_step": step["metrics"],
        "save_state": state["path"],
        "sampler_weights": sampler["path"],
        "seconds": round(time.monotonic() - t0, 1),
    }


def run_service(rc: Any, workdir: Path, timeout: float) -> dict[str, Any]:
    """A service-mode job's scaled run: its processes started as for the RL loop (the CPU model: the
    service builds the tiny one), until the Tinker API answers ``healthz`` and
    ``get_server_capabilities`` on the trainer's port, then a training client's device operations through
    the API (rehearse_service: on a multi-host trainer every process runs them); then stopped."""
    from rljob.common.http import NO_RETRY, HttpError, HttpStatusError, shared
    from rljob.recipes.runconfig import API_KEYS_ENV

    js = jobset_of(rc)
    sampler_ports = [free_port(span=2) for _ in range(rc.sampler.replicas)]
    coord_port, api_port = free_port(), free_port()
    local = local_run_config(rc, workdir, sampler_ports, coord_port, api_port)
    cfg = workdir / "run.json"
    cfg.write_text(local.model_dump_json(by_alias=True), encoding="utf-8")
    gcs, storage_env = start_storage(workdir)
    # The key spec.service.apiKeySecret's Secret gives the trainer in a cluster (the service refuses to
    # start without one); the drill's requests send none, so the API answers 401.
    key = f"tml-drill-{secrets.token_hex(16)}"
    storage_env = {**storage_env, API_KEYS_ENV: key}
    t0 = time.monotonic()
    procs: list[Proc] = []
    try:
        procs, trainers, _ = launch(
            rc, js, cfg, workdir, coord_port, storage_env, ["--model", "tiny"], "tiny"
        )
        base = f"http://127.0.0.1:{api_port}/api/v1"
        caps: Any = None
        while caps is None:
            for p in procs:
                if p.popen.poll() is not None:
                    raise DrillFailed(f"{p.label} exited {p.popen.returncode}:\n{p.tail()}")
            if time.monotonic() - t0 > timeout:
                raise DrillFailed(
                    f"the API did not answer in {timeout:.0f} s; {trainers[0].label}:\n{trainers[0].tail()}"
                )
            try:
                shared().get(f"{base}/healthz", timeout=5, retry=NO_RETRY)
                caps = shared().get_json(f"{base}/get_server_capabilities", timeout=5, retry=NO_RETRY)
            except HttpStatusError as e:
                if e.status != 401:  # 401: the API answers and wants a key (spec.service.apiKeySecret)
                    raise DrillFailed(f"the API answered {e.status}: {e.body[:300]!r}") from None
                caps = {"X-API-Key": "required (spec.service.apiKeySecret)"}
            except HttpError:
                time.sleep(0.5)
        left = max(30.0, timeout - (time.monotonic() - t0))
        rehearsal = rehearse_service(base, key, rc, left)
        for p in trainers:  # every process of the trainer is still running the service
            if p.popen.poll() is not None:
                raise DrillFailed(f"{p.label} exited {p.popen.returncode}:\n{p.tail()}")
    finally:
        stop(procs)
        gcs.terminate()
        gcs.wait(timeout=20)
    return {
        "processes": len(procs),
        "trainer_processes": len(trainers),
        "steps": 0,
        "service": {"api": rc.spec.service.api, "capabilities": caps, "rehearsal": rehearsal},
        "run_seconds": round(time.monotonic() - t0, 1),
    }
