"""Inputs of `hfplan execute` checked before any worker starts: data files, hyperparameter overrides,
hardware, layouts and batch shapes."""

from __future__ import annotations

import json

import pytest

from hfplan.errors import HfplanError
from hfplan.executor import preflight
from hfplan.executor.data import PromptStream, read_prompts
from hfplan.hyperparams import Hyperparameters, with_overrides
from hfplan.plan import InferConfig, TrainConfig
from hfplan.spec import make_cluster
from tests.support.plans import build_plan, small_workload


def demo_plan(micro_batch=2, **overrides):
    shape = dict(prompt_len=16, response_len=16, batch_prompts=8, mini_batches=2) | overrides
    workload = small_workload("ppo", "tiny", models={"actor": "tiny", "critic": "tiny", "reference": "tiny",
                                                     "reward": "rule:vowel-fraction"}, **shape)
    return build_plan(workload, [(("actor", "critic", "reference"), 2)], cluster=make_cluster(2, "cpu"),
                      tp=1, gen_tp=1, micro_batch=micro_batch, infer_micro_batch=4)


# -- data -----------------------------------------------------------------------------------------
def test_jsonl_prompts_in_file_order(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "other": 1}\n')
    data = read_prompts(path)
    assert data.prompts == ["a", "b"]
    assert data.columns == {"other": [None, 1]}  # a line without a column has None


def test_parquet_prompts(tmp_path):
    pa = pytest.importorskip("pyarrow")  # the execute extra's
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["x", "y", "z"], "id": [1, 2, 3]}), path)
    data = read_prompts(path)
    assert data.prompts == ["x", "y", "z"]
    assert data.columns == {"id": [1, 2, 3]}


@pytest.mark.parametrize(("name", "content", "needle"), [
    ("p.jsonl", '{"text": "a"}\n', "line 1 has no 'prompt' field"),
    ("p.jsonl", "{not json\n", "line 1 is not JSON"),
    ("p.jsonl", '{"prompt": 3}\n', "is int, not text"),
    ("p.jsonl", "\n", "no prompts"),
    ("p.csv", "prompt\na\n", "expected a .parquet or .jsonl"),
    ("p.parquet", "not parquet", "not a readable parquet file"),
])
def test_bad_datasets_are_one_line_errors(tmp_path, name, content, needle):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(HfplanError, match=needle):
        read_prompts(path)


def test_parquet_without_prompt_column_names_its_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["x"]}), path)
    with pytest.raises(HfplanError, match="no 'prompt' column \\(columns: question\\)"):
        read_prompts(path)


def test_missing_dataset(tmp_path):
    with pytest.raises(HfplanError, match="dataset not found"):
        read_prompts(tmp_path / "none.jsonl")


def test_prompt_stream_covers_every_prompt_once_per_pass_and_repeats_with_the_seed():
    prompts = [f"p{i}" for i in range(10)]
    stream = PromptStream(prompts, batch=4, seed=3)
    first_pass = stream.next_batch().prompts + stream.next_batch().prompts + stream.next_batch().prompts[:2]
    assert sorted(first_pass) == sorted(prompts)
    again = PromptStream(prompts, batch=4, seed=3)
    assert again.next_batch().prompts == first_pass[:4]
    assert PromptStream(prompts, batch=10, seed=4).next_batch().prompts != first_pass


def test_prompt_stream_hands_out_each_prompts_own_columns():
    prompts = [f"p{i}" for i in range(10)]
    stream = PromptStream(prompts, batch=4, seed=3, columns={"answer": [f"a{i}" for i in range(10)]})
    for _ in range(3):
        handed = stream.next_batch()
        assert handed.columns["answer"] == ["a" + p[1:] for p in handed.prompts]


def test_prompt_stream_resumes_from_its_position():
    prompts = [f"p{i}" for i in range(7)]
    straight = PromptStream(prompts, batch=3, seed=1)
    expected = [straight.next_batch() for _ in range(5)]
    resumed = PromptStream(prompts, batch=3, seed=1, position=9)
    assert [resumed.next_batch() for _ in range(2)] == expected[3:]


# -- hyperparameters ------------------------------------------------------------------------------
def test_overrides_parse_as_the_field_type():
    hp = with_overrides(Hyperparameters(), ["actor_lr=3e-4", "kl_estimator=k1", "top_p = 0.9"])
    assert (hp.actor_lr, hp.kl_estimator, hp.top_p) == (3e-4, "k1", 0.9)


@pytest.mark.parametrize(("item", "needle"), [
    ("nope=1", "unknown hyperparameter"),
    ("actor_lr", "expected key=value"),
    ("actor_lr=fast", "actor_lr"),
    ("kl_estimator=k9", "kl_estimator"),
    ("top_p=2", "top_p"),
])
def test_bad_overrides(item, needle):
    with pytest.raises(HfplanError, match=needle):
        with_overrides(Hyperparameters(), [item])


def test_workload_file_carries_hyperparameters():
    workload = small_workload("ppo", "tiny", prompt_len=16, response_len=16,
                              hyperparameters={"actor_lr": "1e-3", "gamma": 0.9})
    assert workload.hyperparameters.actor_lr == 1e-3
    assert workload.hyperparameters.gamma == 0.9
    assert json.loads(workload.model_dump_json())["hyperparameters"]["gamma"] == 0.9


# -- pre-flight -----------------------------------------------------------------------------------
def test_gpu_plan_on_a_machine_without_cuda_is_refused():
    pytest.importorskip("torch")  # how the check looks for CUDA
    plan = demo_plan().model_copy(update={"cluster": make_cluster(8, "a100-80g")})
    with pytest.raises(HfplanError, match="no CUDA device"):
        preflight.check_hardware(plan)


def test_cpu_plan_runs_on_gloo():
    assert preflight.check_hardware(demo_plan()) == ("cpu", "gloo")


def _with_critic(plan, **layouts):
    par = plan.parallelism["critic"].model_copy(update=layouts)
    return plan.model_copy(update={"parallelism": plan.parallelism | {"critic": par}})


def test_tensor_and_pipeline_layouts_and_their_composition_pass():
    plan = demo_plan()
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        preflight.check_layouts(_with_critic(plan, train=TrainConfig(tp=tp, pp=pp, dp=1),
                                             infer=InferConfig(tp=tp, pp=pp, dp=1)))
    with pytest.raises(HfplanError, match="parallelism.critic: .*pp=4 does not divide the 2 layers"):
        preflight.check_layouts(_with_critic(plan, train=TrainConfig(tp=2, pp=4, dp=1)))  # the contract's rule


def test_mini_batches_must_split_on_every_rank():
    plan = demo_plan(micro_batch=1, mini_batches=8)
    with pytest.raises(HfplanError, match="the 1 sequences of a mini-batch do not split evenly over dp=2"):
        preflight.check_layouts(plan)


def test_models_must_share_the_actors_vocabulary():
    workload = small_workload("ppo", "tiny", prompt_len=16, response_len=16, batch_prompts=8, mini_batches=2,
                              models={"actor": "tiny", "critic": "tiny-arith", "reference": "tiny",
                                      "reward": "rule:vowel-fraction"})
    plan = build_plan(workload, [(("actor", "critic", "reference"), 2)], cluster=make_cluster(2, "cpu"),
                      tp=1, gen_tp=1)
    with pytest.raises(HfplanError, match="role critic .* vocabulary of 48"):
        preflight.check_vocabularies(plan)


