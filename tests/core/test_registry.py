import sys
import textwrap

import pytest

from treadle.core.hookspecs import hookimpl
from treadle.core.registry import PluginError, build_registry


class _PolicyPlugin:
    __name__ = "in-process-test-plugin"

    @hookimpl
    def treadle_register_schedule_policies(self, register):
        register("from-test", object)


def test_builtins_register_through_entry_points():
    table = build_registry().table()
    assert table["schedule_policies"]["fcfs"] == "treadle"
    assert table["kv_allocators"]["token"] == "treadle"
    assert table["attention"]["torch_native"] == "treadle"
    assert table["models"]["LlamaForCausalLM"] == "treadle"


def test_in_process_plugin_registers_with_its_provider():
    registry = build_registry(extra_plugins=[_PolicyPlugin()])
    assert registry.get("schedule_policies", "from-test") is object
    assert registry.table()["schedule_policies"]["from-test"] == "in-process-test-plugin"


def test_duplicate_name_names_both_providers():
    class Clash:
        __name__ = "clashing-plugin"

        @hookimpl
        def treadle_register_schedule_policies(self, register):
            register("fcfs", object)

    with pytest.raises(PluginError, match=r"duplicate schedule policy 'fcfs': registered by both '.+' and '.+'") as info:
        build_registry(extra_plugins=[Clash()])
    assert "treadle" in str(info.value) and "clashing-plugin" in str(info.value)


def test_unknown_name_lists_available_with_providers():
    with pytest.raises(PluginError, match=r"unknown KV allocator 'pagd'; available: paged \(from treadle\), token \(from treadle\)"):
        build_registry().get("kv_allocators", "pagd")


def test_config_listed_module_is_loaded(tmp_path, monkeypatch):
    (tmp_path / "my_research_policy.py").write_text(textwrap.dedent("""
        from treadle.core.hookspecs import hookimpl

        @hookimpl
        def treadle_register_schedule_policies(register):
            register("research", dict)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = build_registry(["my_research_policy"])
    assert registry.table()["schedule_policies"]["research"] == "my_research_policy"
    sys.modules.pop("my_research_policy", None)


def test_unimportable_plugin_module_is_a_clear_error():
    with pytest.raises(PluginError, match="cannot import plugin module 'no_such_module_xyz'"):
        build_registry(["no_such_module_xyz"])


def test_a_registry_of_some_kinds_still_loads_third_party_entry_points_and_names_what_it_lacks():
    # The HTTP workers build one for the parsers: treadle's own plugins of other kinds are not imported, while a
    # third-party package's entry point is, whatever it registers (here the installed example's policy).
    registry = build_registry(kinds=("schedule_policies",))
    assert list(registry.table()) == ["schedule_policies"]
    assert registry.table()["schedule_policies"]["shortest-prompt-first"] == "treadle-plugin-example"
    assert registry.table()["schedule_policies"]["fcfs"] == "treadle"
    with pytest.raises(PluginError, match=r"built for schedule_policies only, not for attention backends"):
        registry.get("attention", "torch_native")
