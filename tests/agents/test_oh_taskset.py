"""The bundled offline task set: each check fails before and passes after its reference solution."""

from __future__ import annotations

import json

import pytest

from mars.openhands_integration.tasks import BUNDLED, Task, load_tasks
from mars.openhands_integration.workspace import Workspace

pytestmark = pytest.mark.timeout(120)


def test_bundled_tasks_load():
    tasks = load_tasks("bundled")
    assert len(tasks) >= 6
    assert len({t.id for t in tasks}) == len(tasks)
    assert all(t.prompt and t.check and t.solution for t in tasks)


@pytest.mark.parametrize("task", load_tasks("bundled"), ids=lambda t: t.id)
def test_check_needs_the_solution(task: Task, ws_base):
    ws = Workspace.create(ws_base, task.id, mode="auto", files=task.files)
    try:
        assert ws.run(task.check).returncode != 0, "the check passes on the unsolved task"
        assert ws.run(task.solution).returncode == 0
        res = ws.run(task.check)
        assert res.returncode == 0, res.stderr
    finally:
        ws.cleanup(remove=True)


def test_json_list_task_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"id": 1, "prompt": "p"}]))
    assert load_tasks(p)[0].id == "1"
    p.write_text(BUNDLED.read_text() + BUNDLED.read_text().splitlines()[0] + "\n")
    with pytest.raises(ValueError):
        load_tasks(p)
