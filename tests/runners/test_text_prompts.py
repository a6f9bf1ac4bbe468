"""Text prompts through the model's own tokenizer (a tiny real BPE built at test time): exact
synthesised lengths, counted prompts files, ShareGPT datasets, and multi-turn conversations
against the simulated engine as a real process."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runners import conversations, datasets
from runners.base import EngineConfig
from runners.datasets import Conversation, Turn
from runners.engine import EngineRunner
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput
from runners.loadgen.metrics import prompt_len_gap
from runners.loadgen.prompts_file import check_prompts_file
from runners.loadgen.requests import build_requests
from runners.simulated.launcher import SimulatedLauncher
from runners.tokenizer import PromptTokenizer, load_tokenizer, tokenizer_dir_for
from runners.workload import SLO, DatasetSource, LengthDistribution, MultiTurn, Workload
from tests.builders import simulated_engine
from tests.runners.tiny_model import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]

# Written for these tests, not taken from any dataset.
CONVERSATIONS = [
    {"id": "rivers", "conversations": [
        {"from": "system", "value": "You answer briefly."},
        {"from": "human", "value": "Name three rivers that cross more than one country."},
        {"from": "gpt", "value": "The Danube, the Rhine and the Mekong each cross several."},
        {"from": "human", "value": "Which of them is the longest?"},
        {"from": "gpt", "value": "The Mekong, at roughly four thousand kilometres."}]},
    {"id": "primes", "conversations": [
        {"from": "human", "value": "What is a prime number, in one sentence?"},
        {"from": "gpt", "value": "A whole number above one divisible only by one and itself."},
        {"from": "human", "value": "Is 91 prime?"},
        {"from": "gpt", "value": "No: 91 is 7 times 13."},
        {"from": "human", "value": "And 97?"},
        {"from": "gpt", "value": "Yes, 97 is prime."}]},
    {"id": "too-short", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},
    {"id": "no-reply", "conversations": [{"from": "human", "value": "Anyone there at all?"}]},
    {"id": "bread", "conversations": [
        {"from": "user", "value": "Why does bread dough need time to rise before baking?"},
        {"from": "assistant", "value": "Yeast makes gas that fills the dough and lifts it."}]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    tok = load_tokenizer(model_dir)
    assert tok is not None
    return tok


def _write_sharegpt(path: Path, entries: list[dict], jsonl: bool = False) -> Path:
    if jsonl:
        path.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    else:
        path.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    return path


# -- the tokenizer ------------------------------------------------------------------------------

def test_no_tokenizer_for_token_id_servers_or_config_only_models(model_dir: Path) -> None:
    assert tokenizer_dir_for(model_dir, skip_tokenizer_init=False) == model_dir
    assert tokenizer_dir_for(model_dir, skip_tokenizer_init=True) is None, \
        "a server started with --skip-tokenizer-init takes token ids"
    config_only = REPO_ROOT / "runners" / "model_configs" / "qwen2.5-7b"
    assert tokenizer_dir_for(config_only, skip_tokenizer_init=False) is None
    assert load_tokenizer(None) is None


def test_an_unreadable_tokenizer_json_is_one_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json: expected a tokenizers-library"):
        load_tokenizer(tmp_path)


def test_a_bos_asked_for_only_by_tokenizer_config_is_noted_as_a_possible_gap(
        tmp_path: Path) -> None:
    plain = make_tiny_model(tmp_path / "plain", bos=False)
    plain_tok = load_tokenizer(plain)
    assert plain_tok is not None and plain_tok.num_special_tokens == 0 and plain_tok.note is None
    doubtful = make_tiny_model(tmp_path / "doubtful", bos=False)
    (doubtful / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    tok = load_tokenizer(doubtful)
    assert tok is not None and tok.note is not None and "add_bos_token" in tok.note
    spec = build_requests(Workload(input_len=LengthDistribution(mean=20),
                                   tokenizer_dir=plain), 1, 0)[0]
    assert spec.prompt_len == plain_tok.count(str(spec.prompt)) == 20, \
        "no special token to count"


def test_synthesised_text_prompts_are_exactly_the_drawn_token_length(
        model_dir: Path, tokenizer: PromptTokenizer) -> None:
    fixed = Workload(input_len=LengthDistribution(mean=77), tokenizer_dir=model_dir)
    for spec in build_requests(fixed, 40, seed=3):
        assert isinstance(spec.prompt, str), "a model with a tokenizer gets text prompts"
        assert spec.prompt_len == tokenizer.count(spec.prompt) == 77, \
            "the server's count (BOS included) is the drawn length"
        assert not spec.is_prompt_len_estimated
    uniform = Workload(input_len=LengthDistribution(kind="uniform", low=2, high=600),
                       tokenizer_dir=model_dir)
    specs = build_requests(uniform, 60, seed=4)
    lengths = [tokenizer.count(s.prompt) for s in specs if isinstance(s.prompt, str)]
    assert lengths == [s.prompt_len for s in specs]
    assert all(2 <= n <= 600 for n in lengths) and len(set(lengths)) > 30


def test_synthesised_request_i_does_not_depend_on_how_many_are_built(model_dir: Path) -> None:
    w = Workload(input_len=LengthDistribution(kind="uniform", low=5, high=200),
                 tokenizer_dir=model_dir)
    assert build_requests(w, 20, seed=9)[:5] == build_requests(w, 5, seed=9)
    assert build_requests(w, 5, seed=9) != build_requests(w, 5, seed=10)


def test_without_a_tokenizer_prompts_stay_token_ids() -> None:
    spec = build_requests(Workload(input_len=LengthDistribution(mean=33)), 1, 0)[0]
    assert isinstance(spec.prompt, list) and len(spec.prompt) == spec.prompt_len == 33


def test_prompts_file_text_is_counted_with_the_tokenizer_and_estimated_without(
        tmp_path: Path, model_dir: Path, tokenizer: PromptTokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": text}) + "\n" + json.dumps({"prompt": [5, 6, 7]})
                    + "\n", encoding="utf-8")
    counted = build_requests(Workload(prompts_file=path, tokenizer_dir=model_dir), 2, 0)
    assert counted[0].prompt_len == tokenizer.count(text) and \
        not counted[0].is_prompt_len_estimated
    estimated = build_requests(Workload(prompts_file=path), 2, 0)
    assert estimated[0].prompt_len == len(text) // 4 and estimated[0].is_prompt_len_estimated
    assert estimated[1].prompt_len == 3 and not estimated[1].is_prompt_len_estimated, \
        "token ids are counted exactly either way"
    assert check_prompts_file(path, tokenizer) == tokenizer.count(text)


def test_an_estimate_counts_utf8_bytes_so_cjk_is_not_read_as_a_quarter_of_its_length(
        tmp_path: Path) -> None:
    # chars / 4 read 384 Chinese characters as 96 tokens; a byte-level BPE spends about a token
    # a character there, so a fit check against max_model_len passed prompts that did not fit.
    english = "The quick brown fox jumps over the lazy dog near the river bank."
    chinese = "大型语言模型的高效服务需要对请求进行仔细的批处理" * 16  # 384 characters
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n"
                            for p in (english, chinese)), encoding="utf-8")
    estimated = build_requests(Workload(prompts_file=path), 2, 0)
    assert [s.prompt_len for s in estimated] == [len(english) // 4, 384 * 3 // 4]
    assert all(s.is_prompt_len_estimated for s in estimated)


def test_prompt_len_gap_is_server_minus_client_over_successes() -> None:
    outputs = [RequestOutput(success=True, client_prompt_len=10, server_prompt_len=11),
               RequestOutput(success=True, client_prompt_len=20, server_prompt_len=17),
               RequestOutput(success=False, client_prompt_len=5, server_prompt_len=99),
               RequestOutput(success=True, client_prompt_len=7)]
    assert prompt_len_gap(outputs) == {
        "prompt_tokens_server_minus_client_mean": -1.0,
        "prompt_tokens_server_minus_client_max_abs": 3.0}
    assert prompt_len_gap(outputs[3:]) == {}, "nothing to compare without usage"


# -- ShareGPT datasets --------------------------------------------------------------------------

def test_sharegpt_requests_are_first_user_turns_with_reply_lengths_as_vllm_reads_them(
        tmp_path: Path, model_dir: Path, tokenizer: PromptTokenizer) -> None:
    path = _write_sharegpt(tmp_path / "chats.json", CONVERSATIONS)
    source = DatasetSource(path=path)
    w = Workload(dataset=source, tokenizer_dir=model_dir)
    specs = build_requests(w, 9, seed=1)
    firsts = {c["id"]: (c["conversations"][1 if c["id"] == "rivers" else 0]["value"],
                        c["conversations"][2 if c["id"] == "rivers" else 1]["value"])
              for c in CONVERSATIONS if c["id"] in ("rivers", "primes", "bread")}
    by_prompt = {user: reply for user, reply in firsts.values()}
    assert {s.prompt for s in specs} == set(by_prompt), \
        "the usable conversations only: too short and reply-less ones are left out"
    for spec in specs:
        assert isinstance(spec.prompt, str)
        assert spec.prompt_len == tokenizer.count(spec.prompt)
        assert spec.output_len == len(tokenizer.encode(by_prompt[spec.prompt]))
    assert specs[:3] == specs[3:6], "a short dataset is cycled in the same order"
    assert build_requests(w, 2, seed=1) == specs[:2], "request i is the same for any num"

    jsonl = _write_sharegpt(tmp_path / "chats.jsonl", CONVERSATIONS, jsonl=True)
    assert build_requests(replace(w, dataset=DatasetSource(path=jsonl)), 9, 1) == specs

    fixed = build_requests(replace(w, dataset=replace(source, output_len=5)), 3, 1)
    assert {s.output_len for s in fixed} == {5}


def test_sharegpt_without_a_tokenizer_estimates_and_says_so(tmp_path: Path) -> None:
    path = _write_sharegpt(tmp_path / "chats.json", CONVERSATIONS)
    specs = build_requests(Workload(dataset=DatasetSource(path=path)), 3, seed=1)
    assert all(s.is_prompt_len_estimated for s in specs)
    assert all(s.prompt_len == len(s.prompt) // 4 for s in specs)


def _as_openai(entry: dict) -> dict:
    roles = {"human": "user", "gpt": "assistant"}
    return {"id": entry["id"], "messages": [
        {"role": roles.get(t["from"], t["from"]),
         "content": [{"type": "text", "text": t["value"]}] if k == 1 else t["value"]}
        for k, t in enumerate(entry["conversations"])]}


def test_openai_messages_a_single_object_and_blank_turns_read_as_sharegpt(
        tmp_path: Path) -> None:
    source = DatasetSource(path=_write_sharegpt(tmp_path / "chats.json", CONVERSATIONS))
    specs = build_requests(Workload(dataset=source), 6, seed=1)
    openai = _write_sharegpt(tmp_path / "messages.jsonl",
                             [_as_openai(e) for e in CONVERSATIONS], jsonl=True)
    assert build_requests(Workload(dataset=DatasetSource(path=openai)), 6, 1) == \
        specs, "role/content turns (content as a string or text parts) are the same turns"
    blank = {"id": "blank", "conversations": [
        {"from": "gpt", "value": "Hello, what would you like to know today?"},
        {"from": "human", "value": "  \n "}, {"from": "gpt", "value": "Could you say more?"},
        {"from": "human", "value": "Why is the sky blue at noon? 🌞"},
        {"from": "gpt", "value": "Sunlight scatters off air molecules, blue light most."}]}
    one = tmp_path / "one.json"
    one.write_text(json.dumps(blank, indent=2, ensure_ascii=False), encoding="utf-8")
    (conversation,) = datasets.read_conversations(one)
    assert conversation[1] == ((blank["conversations"][3]["value"],
                                blank["conversations"][4]["value"]),), \
        "one pretty-printed object is one entry; a blank user turn is no prompt"
    asked = _write_sharegpt(tmp_path / "asked.jsonl", [
        {"id": "q", "messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Which planet has most moons?"}]}],
        jsonl=True)
    (spec,) = build_requests(
        Workload(dataset=DatasetSource(path=asked, output_len=7)), 1, seed=0)
    assert (spec.prompt, spec.output_len) == ("Which planet has most moons?", 7), \
        "an unanswered single turn is a prompt where the output length is fixed"
    with pytest.raises(ValueError, match="no conversation has a user turn and a reply"):
        datasets.check_dataset(DatasetSource(path=asked), None)


def test_a_byte_order_mark_and_a_lone_surrogate_neither_refuse_nor_fail_requests(
        tmp_path: Path, model_dir: Path, tokenizer: PromptTokenizer) -> None:
    broken = {"id": "cut-emoji", "conversations": [
        {"from": "human", "value": "Which emoji is this one: \ud83d and what does it mean?"},
        {"from": "gpt", "value": "A face cut in half by a broken export, most likely."}]}
    path = tmp_path / "bom.json"
    path.write_text("\ufeff" + json.dumps([broken]), encoding="utf-8")  # \ud83d stays escaped
    (spec,) = build_requests(Workload(dataset=DatasetSource(path=path),
                                      tokenizer_dir=model_dir), 1, seed=0)
    assert isinstance(spec.prompt, str) and "\ufffd" in spec.prompt, \
        "the lone surrogate is U+FFFD: sendable as UTF-8, countable by the tokenizer"
    assert spec.prompt_len == tokenizer.count(spec.prompt)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\ufeff" + json.dumps({"prompt": "Tell me \ud83d more."}) + "\n",
                       encoding="utf-8")
    (line,) = build_requests(Workload(prompts_file=prompts), 1, seed=0)
    assert line.prompt == "Tell me \ufffd more."


def test_a_malformed_sharegpt_entry_is_one_error_naming_file_entry_and_fix(
        tmp_path: Path) -> None:
    bad = [*CONVERSATIONS[:2], {"id": "x", "conversations": [{"from": "human"}]}]
    path = _write_sharegpt(tmp_path / "bad.json", bad)
    with pytest.raises(ValueError) as info:
        datasets.check_dataset(DatasetSource(path=path), None)
    message = str(info.value)
    assert str(path) in message and "entry 2 (id 'x')" in message and "give each turn" in \
        message and "\n" not in message
    empty = _write_sharegpt(tmp_path / "none.json", [CONVERSATIONS[2]])
    with pytest.raises(ValueError, match="no conversation has a user turn and a reply"):
        datasets.check_dataset(DatasetSource(path=empty), None)


# -- multi-turn ---------------------------------------------------------------------------------

@pytest.fixture
def simulated(model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """The simulated engine serving the tiny model (its tokenizer counts text prompts)."""
    with simulated_engine(tmp_path, EngineConfig(str(model_dir), {}, served_model_name="sim"),
                          startup_time_scale=0.001) as url:
        yield url


def test_each_turn_is_sent_after_the_last_reply_and_carries_it(
        simulated: str, model_dir: Path, tmp_path: Path, tokenizer: PromptTokenizer) -> None:
    path = _write_sharegpt(tmp_path / "chats.json", CONVERSATIONS)
    w = Workload(dataset=DatasetSource(path=path), tokenizer_dir=model_dir,
                 multi_turn=MultiTurn())
    dialogues = conversations.build_conversations(w, 6, seed=2)
    assert sum(len(c.turns) for c in dialogues) >= 6
    assert {len(c.turns) for c in dialogues} <= {1, 2, 3}
    assert any(len(c.turns) > 1 for c in dialogues), "some conversation has later turns"
    result, turns, num_cut = conversations.run_conversations_sync(
        simulated, "sim", dialogues, LoadLevel(max_concurrency=2), SLO(), timeout_s=30,
        tokenizer_dir=model_dir)
    assert num_cut == 0
    assert result.metrics.failed == 0 and result.metrics.completed == len(turns)
    assert result.metrics.completed == sum(len(c.turns) for c in dialogues)
    for index, dialogue in enumerate(dialogues):
        mine = sorted((t for t in turns if t.conversation == index), key=lambda t: t.turn)
        assert [t.turn for t in mine] == list(range(len(dialogue.turns)))
        for before, after in itertools.pairwise(mine):
            out_b, out_a = before.output, after.output
            assert after.sent_s >= before.ended_s, "turn k+1 is sent once turn k has ended"
            # The next prompt holds the previous prompt, its whole reply and a new message.
            assert out_a.prompt_len > out_b.prompt_len + out_b.output_tokens, \
                "the prompt grows by the reply and the next user message"
        for t in mine:
            assert t.output.server_prompt_len == t.output.client_prompt_len, \
                "the client and the simulated server count with the same tokenizer"
    assert max(t.output.prompt_len for t in turns) > max(t.user_len for c in dialogues
                                                         for t in c.turns)


def test_a_conversation_ends_before_a_turn_the_servers_replies_pushed_past_the_context(
        simulated: str, model_dir: Path, tokenizer: PromptTokenizer) -> None:
    user = Turn("Name a river that crosses more than one country, please.", 0, 40)
    user = replace(user, user_len=tokenizer.count(user.user))
    dialogue = Conversation("long", (user, user, user), is_estimated=False)
    # The dataset's own lengths fit three turns in 200 tokens; the simulated engine's replies
    # re-tokenize longer than 40 tokens, so the third turn's counted prompt would not.
    budget = 3 * (user.user_len + 40)
    result, turns, num_cut = conversations.run_conversations_sync(
        simulated, "sim", [dialogue], LoadLevel(max_concurrency=1), SLO(), timeout_s=30,
        tokenizer_dir=model_dir, max_context_len=budget)
    assert result.metrics.failed == 0, "no turn is sent for the server to refuse"
    assert all(t.output.prompt_len + 40 <= budget for t in turns)
    assert num_cut == 1 and len(turns) < 3


def test_synthesised_conversations_draw_user_turns_of_exact_lengths(
        model_dir: Path, tokenizer: PromptTokenizer) -> None:
    w = Workload(input_len=LengthDistribution(mean=40), output_len=LengthDistribution(mean=8),
                 tokenizer_dir=model_dir, multi_turn=MultiTurn(num_turns=3))
    dialogues = conversations.build_conversations(w, 7, seed=0)
    assert len(dialogues) == 3 and all(len(c.turns) == 3 for c in dialogues)
    assert all(tokenizer.count(t.user) == t.user_len == 40 and t.reply_len == 8
               for c in dialogues for t in c.turns)
    assert conversations.build_conversations(w, 2, seed=0) == dialogues[:1]
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        conversations.build_conversations(replace(w, tokenizer_dir=None), 2, seed=0)


def test_a_dataset_multi_turn_trial_runs_end_to_end_on_the_simulated_engine(
        tmp_path: Path, model_dir: Path) -> None:
    """One trial's whole path (launch, readiness, warm-up, two levels, teardown) with text
    prompts from a ShareGPT file, in conversations."""
    path = _write_sharegpt(tmp_path / "chats.json", CONVERSATIONS)
    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001, seed=0),
                          tmp_path / "engines")
    workload = Workload(dataset=DatasetSource(path=path), tokenizer_dir=model_dir,
                        multi_turn=MultiTurn(), output_len=LengthDistribution(mean=16),
                        levels=(LoadLevel(max_concurrency=1), LoadLevel(max_concurrency=3)),
                        num_requests=8, num_warmup_requests=2, startup_timeout_s=60)
    try:
        result = runner.run(EngineConfig(str(model_dir), {}, served_model_name="sim"),
                            workload, tmp_path / "trial")
    finally:
        runner.close()
    assert result.status == "complete", result.failure
    for step in result.steps:
        server = step.server_metrics
        assert step.metrics.completed >= 8 and step.metrics.failed == 0
        assert server["prompt_tokens_server_minus_client_max_abs"] == 0.0
        assert server["prompt_len_is_estimated"] == 0.0
        assert server["multi_turn.num_turns"] == step.metrics.completed
        assert "multi_turn.later_turns_mean_ttft_ms" in server
    assert np.isfinite(result.steps[-1].metrics.p99_ttft_ms)


def test_the_example_dataset_study_passes_the_checks_before_start(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from optimizer.config import check_before_start, load_study

    monkeypatch.chdir(tmp_path)
    cfg = load_study(REPO_ROOT / "examples" / "dataset.yaml")
    check_before_start(cfg)
    workload = cfg.workload
    assert workload.dataset is not None and workload.multi_turn is not None
    assert workload.tokenizer_dir is None, "a bundled shape has no tokenizer.json"
    dialogues = conversations.build_conversations(workload, 64, seed=0)
    assert all(c.is_estimated for c in dialogues)
    assert "synthetic-greeting" not in {c.id for c in dialogues}, \
        "a prompt under min_len tokens is left out, as vLLM's filter does"


def test_shared_prefix_text_prompts_start_with_one_prefix_and_are_counted_whole(
        model_dir: Path) -> None:
    from runners.workload import SharedPrefix

    workload = Workload(input_len=LengthDistribution(mean=24), tokenizer_dir=model_dir,
                        shared_prefix=SharedPrefix(fraction=0.5, num_tokens=40))
    requests = build_requests(workload, 8, seed=3)
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None
    shared = [r for r in requests if r.prompt_len > 30]
    assert len(shared) == 4
    prefix = shared[0].prompt
    assert isinstance(prefix, str)
    head = prefix[:prefix.index("\n") + 1]
    assert all(isinstance(r.prompt, str) and r.prompt.startswith(head) for r in shared)
    # Each joined prompt's length is the tokenizer's count of the whole text, not a sum.
    assert all(r.prompt_len == tokenizer.count(str(r.prompt)) for r in requests)
