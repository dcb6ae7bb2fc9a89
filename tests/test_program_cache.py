"""The key and the entries of `program_cache` (what `compile_for_gpu` keeps in JAX's cache dir).

`tests/test_gpu_program.py` compiles real programs through the cache; these read the key's
reduction of MLIR locations and the entries' crash safety without compiling.
"""

import gzip
import json
import os
import time

import pytest

from optax_offload._src import program_cache

OP = "%0 = stablehlo.sine %arg0 : tensor<8xf32> loc({})"


def module(loc_of_op: str, *defs: str) -> str:
  return "\n".join([OP.format(loc_of_op), *defs])


def test_the_callers_frames_leave_the_key_and_the_names_stay():
  # The same operation lowered from two callers: another chain of frames, other files and lines.
  called_once = module(
    "#loc4",
    '#loc1 = loc("/work/tests/test_a.py":10:4 to :30)',
    '#loc2 = loc("test_a"(#loc1))',
    "#loc3 = loc(callsite(#loc2 at #loc2))",
    '#loc4 = loc("jit(step)/sin"(#loc3))',
  )
  called_deeper = module(
    "#loc9",
    '#loc1 = loc("/ci/tests/test_a.py":12:4 to 13:2)',
    '#loc2 = loc("test_a"(#loc1))',
    '#loc5 = loc("/venv/_pytest/python.py":150:8)',
    '#loc6 = loc("pytest_pyfunc_call"(#loc5))',
    "#loc7 = loc(callsite(#loc6 at #loc2))",
    "#loc8 = loc(callsite(#loc2 at #loc7))",
    '#loc9 = loc("jit(step)/sin"(#loc8))',
  )
  reduced = program_cache.module_key_text(called_once)
  assert reduced == OP.format('"jit(step)/sin"')
  assert program_cache.module_key_text(called_deeper) == reduced
  # Another innermost frame below the name: JAX reuses a jaxpr it traced once, with the frames of
  # whichever caller traced it first (XLA's op_name is the name alone).
  first_traced_elsewhere = called_once.replace('"test_a"', '"streamed_loss_fn"')
  assert program_cache.module_key_text(first_traced_elsewhere) == reduced
  # Another name (a jax.named_scope): another op_name in the HLO, another key.
  renamed = called_once.replace("jit(step)/sin", "jit(step)/scaled/sin")
  assert program_cache.module_key_text(renamed) != reduced
  # A bare traceback: XLA names the operation after its innermost frame, and so does the key.
  for function in ("alpha", "beta"):
    bare = module(
      "#loc3",
      '#loc1 = loc("a.py":1:2)',
      f'#loc2 = loc("{function}"(#loc1))',
      "#loc3 = loc(callsite(#loc2 at #loc2))",
    )
    assert program_cache.module_key_text(bare) == OP.format(f'"{function}"')
  # Written in the operation's line (block arguments): the same.
  inline = module("callsite(#loc2 at #loc2)", '#loc1 = loc("a.py":1:2)', '#loc2 = loc("f"(#loc1))')
  assert program_cache.module_key_text(inline) == OP.format('"f"')


def test_an_operations_own_file_location_stays():
  # A lowering rule may give an operation a bare "file":line:col (XLA writes it as the
  # instruction's source_file and source_line); only a frame's, wrapped in its name, leaves.
  for line in (1, 2):
    own = module("#loc1", f'#loc1 = loc("/src/kernels.py":{line}:1)')
    assert program_cache.module_key_text(own) == OP.format(f'"/src/kernels.py":{line}:1')


def test_strings_are_not_locations():
  # An attribute whose text looks like a location is left as it is (a set_xla_metadata tag).
  reduced = []
  for tag in ("loc(unknown)", "loc()", "loc(#loc1)"):
    text = f'%0 = stablehlo.sine %arg0 {{mhlo.frontend_attributes = {{tag = "{tag}"}}}} loc(#loc)'
    reduced.append(program_cache.module_key_text(f"{text}\n#loc = loc(unknown)"))
    assert f'tag = "{tag}"' in reduced[-1]
  assert len(set(reduced)) == 3


def test_names_are_kept_exactly():
  nested = module('"a"(#loc1)', '#loc1 = loc("b"(#loc))', "#loc = loc(unknown)")
  flat = module('"a(b)"')
  escaped = module('"x\\"y"(#loc)', "#loc = loc(unknown)")
  assert program_cache.module_key_text(nested) == OP.format('"a"')  # XLA stops at the first name
  assert program_cache.module_key_text(flat) == OP.format('"a(b)"')
  assert program_cache.module_key_text(escaped) == OP.format('"x\\"y"')
  assert program_cache.module_key_text(module("unknown")) == OP.format("")
  # An op type (XLA's op_type) wraps the name: both stay, the frames below them leave.
  typed = module('"scatter-add:"(#loc2)', '#loc2 = loc("jit(f)/scatter-add"(#loc1))')
  frames = ["#loc1 = loc(callsite(#loc3 at #loc3))", '#loc3 = loc("f"("a.py":1:2))']
  want = OP.format('"scatter-add:"("jit(f)/scatter-add")')
  assert program_cache.module_key_text("\n".join([typed, *frames])) == want
  # A name ending in ":" before an "@" is an op type too (XLA reads the name up to the "@"): what
  # it wraps names the operation.
  for helper in ("helper_a", "helper_b"):
    at = module('"s:@x"(#loc2)', f'#loc2 = loc("{helper}"(#loc1))', '#loc1 = loc("a.py":1:2)')
    assert program_cache.module_key_text(at) == OP.format(f'"s:@x"("{helper}")')


def test_a_location_of_another_form_keeps_the_whole_text():
  # MLIR's fused locations are not among the forms JAX writes: the text stays whole, frames and
  # all (a miss between callers, never a hit between programs whose names or frames differ).
  for loc_of_op, defs in [
    ("#loc3", ['#loc1 = loc("a.py":1:2)', '#loc3 = loc(fused[#loc1, "n"])']),
    ('"jit(f)/sin"(#loc3)', ['#loc1 = loc("a.py":1:2)', '#loc3 = loc(fused[#loc1, "n"])']),
    ("fused[#loc1]", ['#loc1 = loc("jit(f)/sin")']),  # one written in the operation's line
    ('"a"(#loc3)', ['#loc3 = loc("Sin:"(#loc4))', '#loc4 = loc("jit(f)/sin")']),  # a type below
    ('"a"(#loc3)', ['#loc3 = loc("s:@x"(#loc4))', '#loc4 = loc("jit(f)/sin")']),  # XLA cuts at @
  ]:
    text = module(loc_of_op, *defs)
    assert program_cache.module_key_text(text) == text
    other = text.replace('"n"', '"m"').replace("jit(f)/sin", "jit(f)/cos")  # locations only
    assert program_cache.module_key_text(other) != program_cache.module_key_text(text)


def test_the_key_covers_every_input_of_the_compile(monkeypatch):
  base = ("module", "config", b"options")
  key = program_cache.entry_key(*base)
  assert key == program_cache.entry_key(*base)
  for i, other in enumerate(("module2", "config2", b"options2")):
    changed = list(base)
    changed[i] = other
    assert program_cache.entry_key(*changed) != key
  for name, other in [
    ("FORMAT", "another format"),
    ("_versions", lambda: "jaxlib==0.0.1"),
    ("_xla_flags", lambda: "--xla_gpu_enable_triton_gemm=false"),
  ]:
    with monkeypatch.context() as m:
      m.setattr(program_cache, name, other)
      assert program_cache.entry_key(*base) != key, name


@pytest.mark.parametrize(
  "damage",
  ["truncated", "flipped", "not_gzip", "not_json", "a_list"],
)
def test_an_entry_that_cannot_be_read_is_a_miss(tmp_path, damage):
  key = program_cache.entry_key("m", "c", b"o")
  program_cache.store(str(tmp_path), key, {"hlo": "HloModule m" * 1000})
  (path,) = tmp_path.glob(f"*{program_cache.SUFFIX}")
  data = path.read_bytes()
  if damage == "truncated":
    data = data[: len(data) // 2]
  elif damage == "flipped":  # the deflate stream itself: zlib's error, not gzip's CRC check
    data = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
  elif damage == "not_gzip":
    data = b"plain text"
  elif damage == "not_json":
    data = gzip.compress(b"{not json")
  else:
    data = gzip.compress(json.dumps([1, 2]).encode())
  path.write_bytes(data)
  assert program_cache.load(str(tmp_path), key) is None
  program_cache.store(str(tmp_path), key, {"hlo": "again"})  # written again, whole
  assert program_cache.load(str(tmp_path), key) == {"hlo": "again"}
  assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path):
  blocked = tmp_path / "a_file"
  blocked.write_text("")
  program_cache.store(str(blocked / "cache"), "k", {"hlo": ""})  # no error
  assert blocked.read_text() == ""


def test_a_killed_writers_temporary_file_is_removed_an_hour_later(tmp_path):
  stale, fresh = tmp_path / ".optax_offload_gpu-a.tmp", tmp_path / ".optax_offload_gpu-b.tmp"
  other = tmp_path / ".other-c.tmp"  # not ours
  for p in (stale, fresh, other):
    p.write_bytes(b"half an entry")
  old = time.time() - program_cache.STALE_TMP_S - 60
  os.utime(stale, (old, old))
  os.utime(other, (old, old))
  program_cache.store(str(tmp_path), "k", {"hlo": ""})
  assert not stale.exists() and fresh.exists() and other.exists()
