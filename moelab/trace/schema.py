"""The on-disk routing-trace format (schema version 1). Open: plain pyarrow/pandas read it.

A trace is a directory::

    meta.json                   model identity and shape, settings, versions, row count
    routes.parquet              one row per (token, MoE layer); columns below
    hidden-00000.safetensors    optional: router-input hidden states, tensor "hidden"
    hidden-00001.safetensors    (rows × H), shard i holding the rows of row group i

Columns of ``routes.parquet``:

==========  ===============  ==========================================================
column      type             meaning
==========  ===============  ==========================================================
seq         int64            sequence id (a batch row of a prompt forward starts one)
step        int32            0 for the prompt (prefill), n for the n-th decode step
pos         int32            position of the token in its sequence, padding excluded
phase       string           ``prefill`` or ``decode``
token_id    int64            input token id (-1 if the model was fed embeddings)
layer       int32            decoder-layer index of the MoE block
moe_layer   int32            ordinal of the block among the MoE layers (0..L-1)
experts     list<int32>      top-k routed expert ids, sorted by descending weight
weights     list<float32>    their router weights (as the model applied them)
scores      list<float32>    full router score vector over all E experts (softmax or
                             sigmoid of the logits, per family); absent if not recorded
==========  ===============  ==========================================================

Rows are written per forward pass, layer-major (all tokens of MoE layer 0, then of
layer 1, ...). Padding tokens are not recorded. A trace being written lives in a
sibling ``.<name>.partial-*`` directory and is renamed into place only when complete,
so a directory with ``meta.json`` is always a finished trace.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
META_FILE = "meta.json"
ROUTES_FILE = "routes.parquet"
HIDDEN_PATTERN = "hidden-{:05d}.safetensors"
PHASES = ("prefill", "decode")


def routes_schema(with_scores: bool) -> pa.Schema:
    fields = [
        pa.field("seq", pa.int64()),
        pa.field("step", pa.int32()),
        pa.field("pos", pa.int32()),
        pa.field("phase", pa.string()),
        pa.field("token_id", pa.int64()),
        pa.field("layer", pa.int32()),
        pa.field("moe_layer", pa.int32()),
        pa.field("experts", pa.list_(pa.int32())),
        pa.field("weights", pa.list_(pa.float32())),
    ]
    if with_scores:
        fields.append(pa.field("scores", pa.list_(pa.float32())))
    return pa.schema(fields)
