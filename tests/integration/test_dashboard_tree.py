"""The job page's tree: root and descendants nested, tenant-scoped, bounded."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from html.parser import HTMLParser

import pytest
from sqlalchemy import text

from jobplane.errors import JobNotFound
from jobplane.store import job_tree
from tests.support.dashboard import UiStack, browserless, ui_stack

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
async def ui(template_db: str, run_id: str, amqp_url: str) -> AsyncIterator[UiStack]:
    """One jobplane and dashboard for the module."""
    async with ui_stack(template_db, run_id, amqp_url) as running:
        yield running


class _Tree(HTMLParser):
    """The drawn tree: each node's parent (None: the root), the highlighted one, the cut notes."""

    def __init__(self) -> None:
        super().__init__()
        self.parents: dict[str, str | None] = {}
        self.current = ""
        self.more: list[str] = []
        self._open: list[str | None] = []  # the <li> stack inside the tree
        self._lists = 0  # the <ul> depth inside the tree
        self._more = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "ul" and (self._lists or found.get("id") == "tree"):
            self._lists += 1
        if not self._lists:
            return
        if tag == "li":
            job = found.get("data-job")
            if job is not None:
                nodes = [n for n in self._open if n is not None]
                self.parents[job] = nodes[-1] if nodes else None
                if "current" in (found.get("class") or ""):
                    self.current = job
            self._open.append(job)
        self._more = tag == "small" and found.get("class") == "more"

    def handle_endtag(self, tag: str) -> None:
        if self._lists and tag == "li":
            self._open.pop()
        if self._lists and tag == "ul":
            self._lists -= 1

    def handle_data(self, data: str) -> None:
        if self._more:
            self.more.append(data.strip())
            self._more = False


async def _tree_of(ui: UiStack, job_id: str) -> _Tree:
    async with browserless(ui.url, ui.stack.key) as http, http.get(f"/jobs/{job_id}") as page:
        assert page.status == 200
        parsed = _Tree()
        parsed.feed(await page.text())
        return parsed


async def _link(ui: UiStack, child: str, parent: str) -> None:
    async with ui.stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET parent_id = :p WHERE id = :c"),
            {"p": uuid.UUID(parent), "c": uuid.UUID(child)},
        )


async def _jobs(ui: UiStack, n: int, key: str | None = None) -> list[str]:
    client = ui.stack.client(key)
    return [(await client.submit("demo.echo", {"n": i})).id for i in range(n)]


async def test_a_grandchilds_page_draws_its_whole_tree_nested(ui: UiStack) -> None:
    root, a, b, grand = await _jobs(ui, 4)
    await _link(ui, a, root)
    await _link(ui, b, root)
    await _link(ui, grand, a)
    tree = await _tree_of(ui, grand)
    assert tree.parents == {root: None, a: root, b: root, grand: a}
    assert tree.current == grand
    # The root's page draws the same tree, the root highlighted.
    tree = await _tree_of(ui, root)
    assert tree.parents == {root: None, a: root, b: root, grand: a}
    assert tree.current == root


async def test_another_tenants_jobs_never_appear_in_the_tree(ui: UiStack) -> None:
    root, child = await _jobs(ui, 2)
    await _link(ui, child, root)
    other_key = await ui.stack.new_key("globex")
    (theirs,) = await _jobs(ui, 1, other_key)
    # Even a row that names our job as its parent (no API writes one) stays theirs.
    await _link(ui, theirs, root)
    tree = await _tree_of(ui, root)
    assert tree.parents == {root: None, child: root}
    assert tree.more == []


async def test_a_job_alone_draws_no_tree(ui: UiStack) -> None:
    (alone,) = await _jobs(ui, 1)
    assert (await _tree_of(ui, alone)).parents == {}


async def test_no_tree_for_a_job_the_tenant_does_not_have(ui: UiStack) -> None:
    """A job gone (or never there) or another tenant's has no tree: JobNotFound,
    as for the job itself."""
    (ours,) = await _jobs(ui, 1)
    other_key = await ui.stack.new_key("initech")
    (theirs,) = await _jobs(ui, 1, other_key)
    service = ui.stack.server.service
    tree = await service.tree(ui.stack.tenant_id, f"jobs/{ours}")
    assert (tree.root.id, tree.root.children, tree.above) == (ours, [], False)
    for job in (str(uuid.uuid4()), theirs):
        with pytest.raises(JobNotFound, match=rf"^jobs/{job} not found$"):
            await service.tree(ui.stack.tenant_id, f"jobs/{job}")


async def test_the_depth_bound_cuts_with_a_count_but_keeps_the_path(ui: UiStack) -> None:
    chain = await _jobs(ui, job_tree.DEPTH + 3)
    for parent, child in itertools.pairwise(chain):
        await _link(ui, child, parent)
    tree = await _tree_of(ui, chain[0])
    assert set(tree.parents) == set(chain[: job_tree.DEPTH + 1])
    assert tree.more == ["1 more"]
    # The deepest job's page reaches the root and draws the path down to it.
    tree = await _tree_of(ui, chain[-1])
    assert set(tree.parents) == set(chain) and tree.current == chain[-1]
    assert all(tree.parents[c] == p for p, c in itertools.pairwise(chain))


async def test_the_node_bound_cuts_with_a_count(
    ui: UiStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_tree, "NODES", 3)
    root, *children = await _jobs(ui, 5)
    for child in children:
        await _link(ui, child, root)
    tree = await _tree_of(ui, root)
    assert len(tree.parents) == 1 + 3
    assert tree.more == ["1 more"]


async def test_the_ancestor_bound_says_there_is_more_above(
    ui: UiStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_tree, "UP", 2)
    chain = await _jobs(ui, 4)
    for parent, child in itertools.pairwise(chain):
        await _link(ui, child, parent)
    async with (
        browserless(ui.url, ui.stack.key) as http,
        http.get(f"/jobs/{chain[-1]}") as page,
    ):
        body = await page.text()
    assert "ancestors above not shown" in body
    assert f'data-job="{chain[0]}"' not in body and f'data-job="{chain[1]}"' in body


def test_the_bounds_are_the_documented_ones() -> None:
    assert (job_tree.UP, job_tree.DEPTH, job_tree.NODES) == (20, 5, 200)
