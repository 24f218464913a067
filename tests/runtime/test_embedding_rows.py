"""Embedding tables read row by row (kvforge.runtime.embedding_rows): the rows a run looks up are
read from weights.data into an anonymous buffer (exact bytes; rows never looked up stay zero and
unresident), negative ids count from the end as Gather's do, and past the budget the buffer is
emptied and refilled. Which tables qualify: read only as the data of a Gather on axis 0 of
``input_ids``. In an engine, a tiny Llama (tied and untied) generates transformers' greedy tokens
with every embedding lookup going through it, under a budget small enough to empty it every step."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from kvforge.runtime.embedding_rows import EmbeddingRows, gather_only_tables

ROWS, COLS = 300, 24


@pytest.fixture
def table_file(tmp_path):
    """A file with 100 bytes of something, then a [ROWS, COLS] float32 table."""
    table = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    path = tmp_path / "weights.data"
    path.write_bytes(b"x" * 100 + table.tobytes())
    return path, table


def test_rows_are_read_on_demand_and_the_rest_stay_zero(table_file):
    path, table = table_file
    rows = EmbeddingRows(path, 100, (ROWS, COLS), np.float32)
    assert rows.array.shape == (ROWS, COLS) and not rows.array.any()
    assert rows.ensure(np.array([[5, 7], [5, 299]])) == 3
    np.testing.assert_array_equal(rows.array[[5, 7, 299]], table[[5, 7, 299]])
    others = np.setdiff1d(np.arange(ROWS), [5, 7, 299])
    assert not rows.array[others].any()
    assert rows.ensure(np.array([7, 5])) == 0  # loaded already: nothing read
    assert rows.ensure(np.array([-1, -300])) == 1  # Gather's negative ids: 299 (loaded) and 0
    np.testing.assert_array_equal(rows.array[0], table[0])
    assert rows.ensure(np.array([ROWS, -ROWS - 1])) == 0  # out of range: left to the Gather to refuse
    assert rows.loaded_count == 4 and rows.resets == 0
    rows.close()


def test_past_the_budget_the_buffer_is_emptied_and_refilled(table_file):
    path, table = table_file
    row_bytes = COLS * 4
    rows = EmbeddingRows(path, 100, (ROWS, COLS), np.float32, budget=4 * row_bytes)
    rows.ensure(np.array([1, 2, 3]))
    rows.ensure(np.array([4]))
    assert rows.resets == 0 and rows.loaded_count == 4
    rows.ensure(np.array([4, 10, 11]))  # 6 rows > 4: emptied, then this run's rows loaded
    assert rows.resets == 1 and rows.loaded_count == 3
    assert sorted(np.flatnonzero(rows.loaded).tolist()) == [4, 10, 11]
    np.testing.assert_array_equal(rows.array[[4, 10, 11]], table[[4, 10, 11]])
    assert not rows.array[[1, 2, 3]].any()  # given back: zeros until looked up again
    rows.close()


def test_a_file_shorter_than_the_table_is_refused(table_file):
    path, _ = table_file
    with pytest.raises(ValueError, match="fewer than the table's end"):
        EmbeddingRows(path, 200, (ROWS, COLS), np.float32)


def _graph(*extra_nodes, indices: str = "input_ids", axis: int = 0) -> onnx.GraphProto:
    tables = []
    for name in ("embed", "other"):
        tensor = numpy_helper.from_array(np.zeros((ROWS, COLS), np.float32), name)
        tensor.data_location = TensorProto.EXTERNAL
        tensor.ClearField("raw_data")
        tensor.external_data.add(key="location", value="weights.data")
        tables.append(tensor)
    nodes = [
        oh.make_node("Cast", ["input_ids"], ["ids_cast"], to=TensorProto.INT64),
        oh.make_node("Gather", ["embed", indices], ["h"], axis=axis),
        oh.make_node("Gather", ["other", "input_ids"], ["h2"]),
        *extra_nodes,
    ]
    inputs = [oh.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])]
    outputs = [oh.make_tensor_value_info("h", TensorProto.FLOAT, None)]
    return oh.make_graph(nodes, "g", inputs, outputs, tables)


def test_which_tables_are_read_row_by_row():
    assert [t.name for t in gather_only_tables(_graph(), "input_ids")] == ["embed", "other"]
    lm_head = oh.make_node("Gemm", ["h", "embed"], ["logits"], transB=1)  # tied, read whole
    assert [t.name for t in gather_only_tables(_graph(lm_head), "input_ids")] == ["other"]
    identity = oh.make_node("Identity", ["other"], ["other_read"])
    assert [t.name for t in gather_only_tables(_graph(identity), "input_ids")] == ["embed"]
    assert [t.name for t in gather_only_tables(_graph(indices="ids_cast"), "input_ids")] == ["other"]
    assert [t.name for t in gather_only_tables(_graph(axis=1), "input_ids")] == ["other"]
    read = [oh.make_node("Identity", ["embed"], ["y"])]
    inner = oh.make_graph(read, "body", [], [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    branch = oh.make_node("If", ["cond"], ["z"], then_branch=inner, else_branch=inner)
    assert [t.name for t in gather_only_tables(_graph(branch), "input_ids")] == ["other"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_engine_generates_transformers_tokens_through_it(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    from kvforge.compile import compile_model
    from kvforge.runtime import Engine
    from tests.helpers import hf_greedy, make_llama

    model_dir = make_llama(tmp_path / "model", tie_word_embeddings=tied)
    out = tmp_path / "out"
    compile_model(model_dir, out, max_batch=2, max_seq=48, score_graph=False, progress=None)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    prompts = [[1, 17, 42, 99, 5], [3, 4, 5]]
    with Engine.load(out, threads=1) as engine:
        [rows] = engine.backend.embedding_rows.values()
        assert rows.rows == 384 and rows.array.shape == (384, 64)
        got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=12)]
        looked_up = np.flatnonzero(rows.loaded)
        assert {t for p in prompts for t in p} <= set(looked_up.tolist()) and len(looked_up) < 384 // 4
        rows.reset()
        rows.budget = 3 * rows.row_bytes  # emptied whenever a step needs a row not loaded
        again = [r.token_ids for r in engine.generate(prompts, max_new_tokens=12)]
        assert rows.resets >= 2  # the reset above, then the budget's (prefill: 8 rows > 3)
    want = [hf_greedy(reference, p, 12) for p in prompts]
    assert got == want and again == want


def test_a_truncated_weights_file_is_an_artifact_error(tmp_path):
    """With verify=False a weights file cut short before the table's end fails at load with the
    artifact's error, not an OSError from the row reader."""
    import shutil

    from kvforge.compile import compile_model
    from kvforge.graphs.manifest import ArtifactError
    from kvforge.runtime import Engine
    from tests.helpers import make_llama

    out = tmp_path / "out"
    compile_model(make_llama(tmp_path / "model"), out, max_batch=1, max_seq=32, score_graph=False, progress=None)
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    weights = broken / "weights.data"
    weights.write_bytes(weights.read_bytes()[:4096])
    with pytest.raises(ArtifactError, match="recompile"):
        Engine.load(broken, threads=1, verify=False)
