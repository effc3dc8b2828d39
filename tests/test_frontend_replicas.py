"""What a frontend says of the engine replicas (frontend/replicas.py): all serving, /health is "ok"; one taken out
(the launcher's ReplicaFailure), /health is still 200 but "degraded" with the counts, /stats names the failure,
/metrics has the replicas started and alive; and a stream its tokenizer worker ends for a failed replica gets the
`replica_failed` error event. (Through the real server: tests/test_data_parallel.py.)"""

from __future__ import annotations

import asyncio

import httpx
from fastapi.testclient import TestClient

from common.engine_replica import REPLICA_FAILED, REPLICA_FAILED_STATUS, ReplicaFailure, ReplicaJoined
from common.messages import RequestRejected
from frontend.app import build_app
from frontend.replicas import NOT_JOINED, EngineReplicas
from tests.fake_engine import FakeEngineClient, Script
from tests.test_frontend_api import sse_events
from tests.test_frontend_metrics import scrape

FAILURE = ReplicaFailure(1, ["scheduler-1", "gpu_worker-1"], "process gpu_worker-1 (pid 42) died with exit code -9")


def client_with(replicas: EngineReplicas) -> tuple[FakeEngineClient, TestClient]:
    engine = FakeEngineClient()
    engine.replicas = replicas
    return engine, TestClient(build_app(engine))


def test_health_is_ok_while_every_replica_serves():
    _, http = client_with(EngineReplicas(2))
    assert http.get("/health").json() == {"status": "ok"}


def test_health_stays_200_but_says_degraded_with_a_replica_out():
    _, http = client_with(EngineReplicas(2).without(FAILURE))
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "degraded", "engine_replicas": 2, "engine_replicas_alive": 1}


def test_stats_name_each_failed_replica_and_why():
    _, http = client_with(EngineReplicas(2).without(FAILURE))
    assert http.get("/stats").json()["engine_replicas"] == {"total": 2, "alive": 1, "failed": {"1": FAILURE.reason}}


def test_a_replica_of_a_node_not_yet_joined_counts_as_out_until_it_joins():
    waiting = EngineReplicas(2, {1: NOT_JOINED})
    _, http = client_with(waiting)
    assert http.get("/health").json() == {"status": "degraded", "engine_replicas": 2, "engine_replicas_alive": 1}
    _, http = client_with(waiting.joined(ReplicaJoined(1, ["scheduler-1", "gpu_worker-1"])))
    assert http.get("/health").json() == {"status": "ok"}


def test_health_is_503_while_no_replica_serves():
    _, http = client_with(EngineReplicas(2, {0: NOT_JOINED, 1: FAILURE.reason}))
    response = http.get("/health")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy", "engine_replicas": 2, "engine_replicas_alive": 0}


def test_metrics_count_the_replicas_started_and_alive():
    _, http = client_with(EngineReplicas(3).without(FAILURE))
    m = scrape(http)
    assert m[("clearserve_engine_replicas", ())] == 3
    assert m[("clearserve_engine_replicas_alive", ())] == 2


async def _post_then_fail_its_replica(engine: FakeEngineClient, body: dict) -> str:
    """POST `body`; once the engine has it (its outputs queued, the request left open), its tokenizer worker ends
    it as it does a failed replica's requests."""
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        while not engine.submitted:
            await asyncio.sleep(0.01)  # a poll, bounded by the caller's wait_for
        rid = engine.submitted[-1].rid
        failed = RequestRejected(rid, REPLICA_FAILED_STATUS, FAILURE.client_message(), code=REPLICA_FAILED)
        engine.streams[rid].put(failed)
        response = await task
        assert response.status_code == 200
        return response.text


def test_a_stream_ended_for_a_failed_replica_gets_the_replica_failed_error_event():
    engine, _ = client_with(EngineReplicas(2).without(FAILURE))
    engine.script = Script(finish_reason=None)  # open after its outputs, until something ends it
    body = {"prompt": "x", "stream": True}
    events = sse_events(asyncio.run(asyncio.wait_for(_post_then_fail_its_replica(engine, body), 10)))
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "message": FAILURE.client_message(),
            "type": "service_unavailable",
            "param": None,
            "code": "replica_failed",
        }
    }


def test_a_request_not_yet_accepted_by_a_failed_replica_is_a_503_to_retry():
    engine, http = client_with(EngineReplicas(2).without(FAILURE))
    engine.script = Script(reject=RequestRejected(0, REPLICA_FAILED_STATUS, "replica 1 failed", code=REPLICA_FAILED))
    response = http.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503 and response.headers["Retry-After"]
    assert response.json()["error"]["code"] == "replica_failed"
