"""The service on PostgreSQL: tests/service/test_flow.py's own flows, collected again over a server whose
store is a fresh database on the session's throwaway PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import pytest

from tests.service.test_flow import (  # noqa: F401 (collected again, over this module's server)
    local,
    test_api_keys_isolate_owners,
    test_cancel_run_cancels_waiting_operations,
    test_client_sft_loss_decreases_and_equals_engine,
    test_close_session_cancels_its_runs,
    test_finish_runs_what_is_queued_and_cancels_after_a_gap,
    test_mixed_run_batch_equals_each_run_alone,
    test_out_of_order_submission_waits_for_the_gap,
    test_restart_keeps_results_and_interrupts_runs,
    test_resume_bound_or_loaded_continues_exactly,
    test_retry_same_seq_id_is_idempotent,
    test_sampler_versions_are_pinned,
    test_sft_flow_over_raw_http,
)


@pytest.fixture
def make_server(make_server, postgres):
    """Servers as tests/service/conftest.py makes them, each on a new PostgreSQL database (a restart test's
    second server on the first one's database)."""
    made = []

    def make(**overrides):
        if "db_url" not in overrides:
            overrides["db_url"] = made[0].config.db_url if made else postgres.new_database()
        made.append(make_server(**overrides))
        return made[-1]

    return make


@pytest.fixture
def server(make_server):
    return make_server()


def test_the_store_is_postgresql(server):
    assert server.app.state.whitney.store.engine.dialect.name == "postgresql"
