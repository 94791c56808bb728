"""The batch suite's core cases on a real Redis Cluster (3 masters + 3 replicas): its
tests imported from ``test_batches`` and run here with this module's ``stack``, the
same settings on a cluster (batch lines' records in their shards, the batch and its
lock under the global tag: ``BatchStore._submit_line_apart``)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from broker.cluster_server import LocalCluster
from tests.e2e.test_batches import (
    batch_models_dir,
    batch_settings,
    client,
    exits,
    test_a_killed_driver_is_replaced_without_losing_or_repeating_lines,
    test_cancel_mid_batch_keeps_partial_results,
    test_fifty_lines_one_invalid,
)
from tests.stack import Stack, batcher_process, full_stack

pytestmark = pytest.mark.e2e

__all__ = [
    "batch_models_dir",
    "client",
    "exits",
    "test_a_killed_driver_is_replaced_without_losing_or_repeating_lines",
    "test_cancel_mid_batch_keeps_partial_results",
    "test_fifty_lines_one_invalid",
]


@pytest.fixture(scope="module")
def stack(
    batch_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, exits: ExitStack
) -> Stack:
    """``test_batches.stack``'s settings, on a cluster."""
    settings = batch_settings(batch_models_dir)
    log_dir = tmp_path_factory.mktemp("logs")
    st = exits.enter_context(full_stack(settings, log_dir, cluster=LocalCluster(3, 1)))
    st.procs["batcher"] = exits.enter_context(batcher_process(st.settings, log_dir))
    return st
