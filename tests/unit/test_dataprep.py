"""Data prepared once per content: records tokenized with the answers masked, kept as a
memory-mapped cache entry keyed by content, reused by every later run, rebuilt when
damaged, and read back as the rows the loop trains on."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.contract import chatdata, datacache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
import tiny  # noqa: E402

from train_entry.dataprep import build, ranks, store  # noqa: E402
from train_entry.dataprep.encode import encode_batch  # noqa: E402
from train_entry.errors import UserCodeError  # noqa: E402


class Said:
    """A heartbeat's beat and event, recorded."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def beat(self, *_a, **_k):
        pass

    def event(self, kind, cause, **_extra):
        self.events.append((kind, cause))

    def kinds(self):
        return [k for k, _ in self.events if k != "data.progress"]


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


def _prepare(tok, path, cache, said=None, num_proc=None) -> store.Examples:
    return ranks.find_or_prepare(ranks.Source([str(path)], "chat"), tok, str(cache), said or Said(), lambda line: None, num_proc)


def _batch(convs):
    return {"file": [0] * len(convs), "line": list(range(1, len(convs) + 1)), "text": [json.dumps(c) for c in convs],
            "error": [None] * len(convs)}


def test_only_the_answers_and_their_end_markers_carry_loss_in_every_turn(tok):
    conv = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "abc"},
                         {"role": "assistant", "content": "cba"}, {"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "olleh"}]}
    out = encode_batch(tok, "chat", lambda f, n: f"d.jsonl:{n}", _batch([conv]))
    ids, target = out["input_ids"][0], out["target"][0]
    # the conversation as the template tokenizes it whole
    assert ids == list(tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=False))
    spans, cur = [], []
    for i, t in zip([*ids, None], [*target, 0]):
        if t:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    assert spans == ["cba<|im_end|>\n", "olleh<|im_end|>\n"] and out["error"] == [None]


def test_bad_records_are_named_by_file_and_line_at_preparation(tmp_path, tok):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n" + '{"messages": []}\n' + "{oops\n")
    with pytest.raises(UserCodeError, match=rf"{path}:4: a chat record needs a non-empty list 'messages'"):
        _prepare(tok, path, tmp_path / "cache")
    assert datacache.entries(tmp_path / "cache") == []  # nothing half-made is left as an entry
    assert [n for n in os.listdir(tmp_path / "cache") if not n.startswith("digests")] == []


def test_prepared_once_then_reused_by_content_whatever_the_file_is_called(tmp_path, tok):
    data = tiny.make_chat_data(tmp_path / "a.jsonl", n=40)
    cache = tmp_path / "cache"
    first, said = _prepare(tok, data, cache), Said()
    again = _prepare(tok, data, cache, said)
    assert said.kinds() == ["data.reused"] and again.entry == first.entry
    copy = tmp_path / "renamed.jsonl"
    copy.write_bytes(data.read_bytes())
    said = Said()
    assert _prepare(tok, copy, cache, said).entry == first.entry and said.kinds() == ["data.reused"]
    copy.write_text(copy.read_text().replace("Reverse it.", "Reverse it!"))  # other content: another entry
    said = Said()
    assert _prepare(tok, copy, cache, said).entry != first.entry and said.kinds() == ["data.prepared"]
    assert len(datacache.entries(cache)) == 2


def test_a_damaged_entry_is_discarded_with_an_event_and_prepared_again(tmp_path, tok):
    data = tiny.make_chat_data(tmp_path / "a.jsonl", n=40)
    cache = tmp_path / "cache"
    first = _prepare(tok, data, cache)
    arrow = first.entry / build.EXAMPLES
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte flipped: only the digest sees it
    arrow.write_bytes(bytes(raw))
    said = Said()
    again = _prepare(tok, data, cache, said)
    assert said.kinds() == ["data.damaged", "data.prepared"] and "content digest" in said.events[0][1]
    again.verify()
    # a truncated file is refused on open by a rank that only maps it (no digest read)
    with open(again.entry / build.EXAMPLES, "r+b") as fh:
        fh.truncate(os.path.getsize(again.entry / build.EXAMPLES) - 10)
    with pytest.raises(datacache.CacheError):
        store.Examples(again.entry)


def test_rows_and_packed_rows_hold_the_examples_cut_and_labelled_as_the_loss_expects(tmp_path, tok):
    data = tiny.make_chat_data(tmp_path / "a.jsonl", n=30, seed=3)
    ex = _prepare(tok, data, tmp_path / "cache")
    n = len(ex)
    idx = store.usable(ex, np.arange(n), 64)
    rows = store.Rows(ex, idx, 64, tok.pad_token_id)
    inputs, labels = rows.collate([rows[0], rows[1]])
    for r, e in enumerate([rows[0], rows[1]]):
        ids, tgt = ex.tokens(e, 64)
        k = len(ids)
        assert inputs["input_ids"][r, :k].tolist() == ids.tolist() and inputs["attention_mask"][r, :k].all()
        want = [int(ids[i + 1]) if tgt[i + 1] else -100 for i in range(k - 1)] + [-100]
        assert labels[r, :k].tolist() == want and (labels[r, k:] == -100).all()
    packed = store.Packed(ex, idx, 128, tok.pad_token_id)
    assert len(packed) < len(idx) and sum(len(packed[r]) for r in range(len(packed))) == len(idx)
    inputs, labels = packed.collate([packed[0]])
    assert "attention_mask" not in inputs
    lens = [len(ex.tokens(e, 128)[0]) for e in packed[0]]
    assert sum(lens) <= 128 and inputs["position_ids"][0, : lens[0]].tolist() == list(range(lens[0]))
    assert inputs["position_ids"][0, lens[0]].item() == 0  # the next example starts again at 0


def test_cut_examples_without_an_answer_left_are_left_out_at_open_not_at_preparation(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    long = {"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "yes"}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a longer answer"}]}
    path.write_text(json.dumps(long) + "\n" + json.dumps(short) + "\n")
    ex = _prepare(tok, path, tmp_path / "cache")
    assert ex.manifest["counts"]["records"] == 2
    assert store.usable(ex, np.arange(2), 32).tolist() == [1]  # the long one's answer is cut off whole
    assert store.usable(ex, np.arange(2), 512).tolist() == [0, 1]  # a longer max_length: the same entry serves
    assert (ex.lengths > 32).tolist() == [True, True]


def test_the_held_out_split_is_a_fixed_disjoint_choice_of_the_checked_size():
    a = store.held_out(1000, 0.1, seed=1)
    assert a.tolist() == store.held_out(1000, 0.1, seed=1).tolist() and len(a) == chatdata.held_out_count(1000, 0.1)
    assert a.tolist() != store.held_out(1000, 0.1, seed=2).tolist()
    assert len(set(a.tolist())) == len(a) and (np.diff(a) > 0).all()
    for n, f in ((2, 0.5), (7, 0.01), (10, 0.99)):
        assert len(store.held_out(n, f, 0)) == chatdata.held_out_count(n, f)


def test_several_processes_prepare_the_same_examples_as_one(tmp_path, tok):
    data = tiny.make_chat_data(tmp_path / "a.jsonl", n=60)
    environ = os.environ
    one = _prepare(tok, data, tmp_path / "one", num_proc=1)
    two = _prepare(tok, data, tmp_path / "two", num_proc=2)
    assert os.environ is environ  # datasets' pool leaves a copy in its place; the process's own is put back
    assert one.entry.name == two.entry.name  # the key is the content's, not how it was prepared
    for i in range(len(one)):
        assert all(np.array_equal(a, b) for a, b in zip(one.tokens(i, 10**6), two.tokens(i, 10**6)))
    assert np.array_equal(one.lengths, two.lengths)


def _as_tables(jsonl: Path, folder: Path) -> tuple[Path, Path]:
    """The same records as a Parquet file (with a column the trainer does not read) and as
    a folder written by datasets' save_to_disk."""
    import datasets

    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    ds = datasets.Dataset.from_list([{**r, "source": "made here"} for r in rows])
    ds.to_parquet(str(folder / "d.parquet"))
    ds.save_to_disk(str(folder / "saved"))
    return folder / "d.parquet", folder / "saved"


@pytest.mark.parametrize("fmt", ["chat", "instruction"])
def test_parquet_files_and_saved_data_sets_prepare_the_same_examples_as_their_json_lines(tmp_path, tok, fmt):
    data = tiny.make_chat_data(tmp_path / "a.jsonl", n=30, fmt=fmt)
    parquet, saved = _as_tables(data, tmp_path)
    cache = tmp_path / "cache"
    prepare = lambda paths, kind: ranks.find_or_prepare(ranks.Source(paths, fmt, kind), tok, str(cache), Said(), print)  # noqa: E731
    ref = prepare([str(data)], "jsonl")
    for got in (prepare([str(parquet)], "parquet"), prepare([str(saved)], "arrow")):
        assert got.entry != ref.entry and len(got) == len(ref) == 30  # another input kind: another entry
        assert got.lines.tolist() == list(range(1, 31))  # a table's records are named by row
        for i in range(len(ref)):
            assert all(np.array_equal(a, b) for a, b in zip(got.tokens(i, 10**6), ref.tokens(i, 10**6)))
    # several inputs read in order make one set; it is reused by content, whatever the files are called
    half = tmp_path / "b.jsonl"
    half.write_text(data.read_text())
    both, said = prepare([str(data), str(half)], "jsonl"), Said()
    assert len(both) == 60 and np.array_equal(both.lengths[:30], ref.lengths) and np.array_equal(both.lengths[30:], ref.lengths)
    assert ranks.find_or_prepare(ranks.Source([str(half), str(data)], fmt, "jsonl"), tok, str(cache), said, print).entry == both.entry
    assert said.kinds() == ["data.reused"]


def test_bad_rows_and_unreadable_tables_are_named_at_preparation_and_nothing_outside_a_saved_folder_is_read(tmp_path, tok):
    import datasets

    from train_entry.dataprep import sources

    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "q"}]}
    datasets.Dataset.from_list([good, good, bad]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(chatdata.RecordError, match=rf"{tmp_path / 'bad.parquet'} row 3: no assistant message"):
        sources.count(str(tmp_path / "bad.parquet"), "parquet", "chat")
    datasets.Dataset.from_list([{"prompt": "p", "completion": "c"}]).to_parquet(str(tmp_path / "inst.parquet"))
    with pytest.raises(UserCodeError, match=r"no column 'messages' \(data.format: chat\); its columns: prompt, completion"):
        sources.count(str(tmp_path / "inst.parquet"), "parquet", "chat")
    with pytest.raises(UserCodeError, match=r"no column 'messages'"):  # the same at preparation, not datasets' wrapper
        ranks.find_or_prepare(ranks.Source([str(tmp_path / "inst.parquet")], "chat", "parquet"), tok, str(tmp_path / "c"), Said(), print)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UserCodeError, match="cannot read as parquet"):
        sources.count(str(tmp_path / "junk.parquet"), "parquet", "chat")
    # a DatasetDict's folder: told which split to name
    datasets.DatasetDict({"train": datasets.Dataset.from_list([good])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserCodeError, match=r"holds several splits \(train\).*e.g. .*dd/train"):
        sources.count(str(tmp_path / "dd"), "arrow", "chat")
    assert sources.count(str(tmp_path / "dd" / "train"), "arrow", "chat") == 1
    # a hostile state.json naming files outside its folder, or a link out of it
    outside = tmp_path / "dd" / "train" / next(p.name for p in (tmp_path / "dd" / "train").glob("*.arrow"))
    for i, name in enumerate(("../../secret.arrow", "/etc/passwd", "sub/x.arrow")):
        hostile = tmp_path / f"hostile-{i}"
        hostile.mkdir()
        (hostile / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
        with pytest.raises(UserCodeError, match=r"_data_files\[0\] is not the plain name of an .arrow file"):
            sources.count(str(hostile), "arrow", "chat")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"_data_files": [{"filename": outside.name}]}))
    link_state = tmp_path / "link-state"
    link_state.mkdir()
    (link_state / "state.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UserCodeError, match=r"state.json: .*not a folder written by save_to_disk"):
        sources.count(str(link_state), "arrow", "chat")  # a state.json that is a link is not followed
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "data.arrow").symlink_to(outside)
    (linked / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    with pytest.raises(UserCodeError, match="names 'data.arrow', which is not a file in"):
        sources.count(str(linked), "arrow", "chat")
