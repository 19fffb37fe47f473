"""One msgspec struct per concept on the wire (issue 46): the type in memory is the type on the wire, it encodes
to the bytes its former wire mirror did (the protocol is unchanged), and its bounds hold wherever it is decoded."""

from __future__ import annotations

import msgspec
import pytest

from vllm_dsa_connector.core.handoff.wire import Route
from vllm_dsa_connector.core.plan.pages import MAX_ENTRIES, PageTable
from vllm_dsa_connector.core.transfer.ipc_desc import IpcDesc
from vllm_dsa_connector.core.transfer.nixl.data import RegionDesc
from vllm_dsa_connector.core.transfer.paths import PathName


def test_a_region_encodes_as_its_former_wire_mirror_and_is_bounded() -> None:
    region = RegionDesc("agent-d", 4096, 1 << 20, "VRAM", 3)
    mirror = {
        "agent": "agent-d",
        "addr": 4096,
        "size": 1 << 20,
        "mem": "VRAM",
        "dev": 3,
    }  # WireRegion's keys
    assert msgspec.msgpack.encode(region) == msgspec.msgpack.encode(mirror)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(mirror), type=RegionDesc) == region
    with pytest.raises(ValueError, match="region description .*agent"):
        RegionDesc.from_dict(
            {**mirror, "agent": "a" * 513}
        )  # a peer's oversize name: refused, not kept
    with pytest.raises(ValueError, match="region description .*mem"):
        RegionDesc.from_dict({**mirror, "mem": "m" * 65})


def test_an_ipc_export_encodes_as_its_former_wire_mirror_and_is_bounded() -> None:
    export = IpcDesc(
        "host/boot",
        "GPU-0",
        1 << 20,
        0,
        (b"\x01" * 64).hex(),
        2 << 20,
        0,
        b"/torch_1_2".hex(),
        0,
        (b"\x02" * 64).hex(),
        True,
    )
    mirror = {
        "host": "host/boot",
        "uuid": "GPU-0",
        "size": 1 << 20,
        "offset": 0,
        "handle": "01" * 64,  # WireIpcExport
        "storage_size": 2 << 20,
        "storage_offset": 0,
        "ref_counter_handle": b"/torch_1_2".hex(),
        "ref_counter_offset": 0,
        "event_handle": "02" * 64,
        "event_sync_required": True,
    }
    assert msgspec.msgpack.encode(export) == msgspec.msgpack.encode(mirror)
    assert export.handles() == (b"\x01" * 64, b"/torch_1_2", b"\x02" * 64)
    with pytest.raises(ValueError, match="IPC region description"):
        IpcDesc.from_dict({**mirror, "handle": "zz"})
    with pytest.raises(ValueError, match="IPC region description"):
        IpcDesc.from_dict(
            {**mirror, "uuid": "u" * 513}
        )  # a peer's oversize name: refused, not kept


def test_a_page_table_is_its_own_wire_form_and_is_bounded() -> None:
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.page_tables import build_offline
    from vllm_dsa_connector.core.handoff.wire import encode

    (table,) = build_offline(glm_dsa_config(6), num_blocks=8)
    plain = table.to_dict()
    assert encode(table) == encode(
        plain
    )  # the bytes the WirePageTable mirror of the dict encoded to
    assert (
        msgspec.msgpack.decode(encode(plain), type=PageTable) == table == PageTable.from_dict(plain)
    )
    with pytest.raises(ValueError, match="malformed page table .*layers"):
        PageTable.from_dict(
            {**plain, "layers": list(range(MAX_ENTRIES + 1))}
        )  # bounded in memory too now
    with pytest.raises(ValueError, match="malformed page table .*role"):
        PageTable.from_dict({**plain, "views": [{**plain["views"][0], "role": "nope"}]})


def test_a_route_names_its_path_by_pathname_with_the_same_bytes() -> None:
    assert msgspec.msgpack.encode(Route(PathName.BOUNCE, 5, 10)) == msgspec.msgpack.encode(
        ["bounce", 5, 10]
    )
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(["ipc", 0, 0]), type=Route)
    assert got.path is PathName.IPC
    with pytest.raises(msgspec.ValidationError, match="written directly has no route"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["direct", 0, 0]), type=Route)
