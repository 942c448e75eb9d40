"""Chapter 5's serving toolkit, in one namespace (``from kvlab import serving as S``).

The pieces live in modules of their own:

* :mod:`kvlab.simulator` — the replica simulator (paged, prefix-cached pool; scheduling; cost model)
  and the chapter's sweeps (:func:`hit_rate_vs_pool`, :func:`cost_table`);
* :mod:`kvlab.workloads` — synthetic workloads with shared prefixes;
* :mod:`kvlab.traces` — recorded traces (Mooncake's format);
* :func:`kvlab.results.quality_by_length` — chapter 4's sweep as a quality column;
* :func:`kvlab.simulator.cost_table_html` — the cost table as HTML.
"""

from .results import quality_by_length
from .simulator import (
    BlockPool,
    CostModel,
    Request,
    SimResult,
    block_hashes,
    cost_table,
    cost_table_html,
    hit_rate_vs_pool,
    pool_blocks,
    request_from_tokens,
    simulate,
    working_set,
)
from .traces import load_trace
from .workloads import (
    WORKLOADS,
    cost_split,
    few_shot,
    multi_turn_chat,
    rag,
    shared_system_prompt,
    without_sharing,
)

__all__ = ["BlockPool", "CostModel", "cost_split", "Request", "SimResult", "WORKLOADS", "block_hashes", "cost_table",
           "cost_table_html", "few_shot", "hit_rate_vs_pool", "load_trace", "multi_turn_chat", "pool_blocks",
           "quality_by_length", "rag", "request_from_tokens", "shared_system_prompt", "simulate",
           "without_sharing", "working_set"]
