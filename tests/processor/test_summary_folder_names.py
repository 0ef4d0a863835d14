"""Run id -> summary folder name (`security.sanitize_run_id`): safe, stable, and injective.

Issue 18 item 10: a run id shaped like another id's sanitised form used to get that
id's folder (and replace its summary). These tests feed the mapping its own output,
random text and ids crafted to sit next to the hashed form.
"""
from __future__ import annotations

import re

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from traceml.launcher import run_dir as rd
from traceml.processor.security import MAX_DIR_NAME, sanitize_run_id, summary_folder

SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._~-]*\Z")

# Text that exercises every branch: safe characters, the characters the hash mark and
# digest use, separators, dots, controls, non-ASCII, and lone surrogates.
_alphabet = st.sampled_from("ab_-.~0f9/\\ \n\x00\x1b\u00e9\u202e")
ids = st.one_of(st.text(_alphabet, max_size=120), st.text(max_size=40))


def test_an_id_shaped_like_another_ids_folder_gets_its_own_folder(tmp_path):
    """The concrete collision: before, `a_b-<sha256('a b')[:10]>` was kept as is and
    took the folder of `a b`, replacing its summary."""
    import hashlib

    other = "a b"
    look_alike_old = "a_b-" + hashlib.sha256(other.encode()).hexdigest()[:10]
    look_alike_new = sanitize_run_id(other).replace("~", "-")  # the nearest safe spelling
    for look_alike in (look_alike_old, look_alike_new, sanitize_run_id(other)):
        assert summary_folder(tmp_path, look_alike) != summary_folder(tmp_path, other), look_alike


def test_ordinary_ids_keep_their_folder_name():
    """Ids that are already safe (including the launcher's generated and fallback
    forms, which end in `-<hex>`) are their own folder name, as before."""
    for run_id in ("run-1", "my.run_2", "20260509-120000-1a2b3c4d", "job-0123456789abcdef",
                   "x" * MAX_DIR_NAME, "a_b-0123456789"):
        assert sanitize_run_id(run_id) == run_id


def test_changed_ids_are_bounded_and_carry_the_hash():
    for run_id in ("../../etc/evil run\n1", ".hidden", "", "x" * (MAX_DIR_NAME + 1), "r\x1b]0;t\x07"):
        name = sanitize_run_id(run_id)
        assert SAFE_NAME.match(name), name
        assert len(name) <= MAX_DIR_NAME and "~" in name


@settings(max_examples=200, deadline=None)
@given(st.lists(ids, min_size=2, max_size=8, unique=True))
@pytest.mark.slow
def test_different_ids_never_share_a_name(run_ids):
    # Each id's own sanitised form (and variants of it) joins the set: the adversarial case.
    candidates = set(run_ids)
    for run_id in run_ids:
        name = sanitize_run_id(run_id)
        candidates |= {name, name.replace("~", "-"), name.replace("~", "_")}
    names = {}
    for run_id in candidates:
        name = sanitize_run_id(run_id)
        assert names.setdefault(name, run_id) == run_id, (run_id, names[name])


@settings(max_examples=150, deadline=None)
@given(ids)
def test_every_name_is_safe_stable_and_sits_under_the_root(tmp_path_factory, run_id):
    name = sanitize_run_id(run_id)
    assert SAFE_NAME.match(name) and len(name) <= MAX_DIR_NAME, name
    assert sanitize_run_id(run_id) == name
    root = tmp_path_factory.getbasetemp()
    assert summary_folder(root, run_id).parent == root.resolve()
    assert rd.run_directory(root, run_id) == summary_folder(root, run_id)  # one owner of the mapping
