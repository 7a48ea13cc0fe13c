import json
import multiprocessing
import threading

from stree.checkpoints.atomic import write_text


def _write_many(path, mark: str, times: int) -> None:
    text = json.dumps({"mark": mark, "payload": [mark] * 20000})
    for _ in range(times):
        write_text(path, text)


def test_two_processes_writing_one_file_never_break_it_or_each_other(tmp_path):
    # (as two decoding processes sharing a cost cache: each write must land whole, and neither
    # writer may fail because the other renamed or deleted its temporary file)
    path = tmp_path / "costs.json"
    write_text(path, json.dumps({"mark": "start", "payload": []}))
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_many, args=(path, mark, 150)) for mark in "ab"]
    for w in writers:
        w.start()
    seen = set()
    while any(w.is_alive() for w in writers):
        seen.add(json.loads(path.read_text())["mark"])  # never half a file
    for w in writers:
        w.join()
    assert [w.exitcode for w in writers] == [0, 0]
    assert json.loads(path.read_text())["mark"] in "ab"
    assert not list(tmp_path.glob("*.tmp"))


def test_two_threads_writing_one_file_both_finish(tmp_path):
    path = tmp_path / "state.json"
    errors = []

    def run(mark):
        try:
            _write_many(path, mark, 150)
        except Exception as e:  # noqa: BLE001 (collected: an exception in a thread is not the test's)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(path.read_text())["mark"] in "ab"
    assert not list(tmp_path.glob("*.tmp"))
