from pathlib import Path

import pytest

from hvtrain.errors import HostfileError
from hvtrain.launch.hostfile import (
    HostSlots,
    parse_hostfile,
    parse_hosts,
    render_host_list,
    render_hostfile,
    total_slots,
)

ROOT = Path(__file__).resolve().parents[2]


def hostfile(tmp_path, text):
    p = tmp_path / "hosts"
    p.write_text(text)
    return p


def test_all_forms_with_blanks_and_comments(tmp_path):
    p = hostfile(tmp_path, "# cluster\n\nnode1 slots=4\n  node2:2   # trailing comment\nnode3\n"
                           "node4 slots=2 max_slots=8\n\n")
    hosts = parse_hostfile(p)
    assert hosts == [HostSlots("node1", 4, None, f"{p}:3"), HostSlots("node2", 2, None, f"{p}:4"),
                     HostSlots("node3", 1, None, f"{p}:5"), HostSlots("node4", 2, 8, f"{p}:6")]
    assert total_slots(hosts) == 9
    assert render_host_list(hosts) == "node1:4,node2:2,node3:1,node4:2"
    assert render_hostfile(hosts, "openmpi").splitlines()[3] == "node4 slots=2 max_slots=8"
    assert render_hostfile(hosts, "mpich").splitlines()[0] == "node1:4"


@pytest.mark.parametrize("line,message", [
    ("node1 slots=", "expected 'host slots=N', 'host:N' or 'host', got 'node1 slots='"),
    ("node1 slots=0", "slots must be a positive integer, got 'node1 slots=0'"),
    ("node1 cores=4", "expected 'host slots=N'"),
    ("node1:x", "slots must be a positive integer"),
    ("node1: 4", "expected 'host slots=N'"),
    ("node1 slots=4 max_slots=2", "max_slots=2 is less than slots=4"),
    ("node1:2 slots=2", "mixes host:N and slots="),
    ("no$de", "invalid host name 'no$de'"),
    ("-oProxyCommand=x", "invalid host name"),
])
def test_errors_name_file_line(tmp_path, line, message):
    p = hostfile(tmp_path, f"# header\n\n{line}\n")
    with pytest.raises(HostfileError) as e:
        parse_hostfile(p)
    assert str(e.value).startswith(f"{p}:3: ")
    assert message in str(e.value)


def test_duplicates_empty_and_missing(tmp_path):
    with pytest.raises(HostfileError, match=r"hosts:2: host 'a' is listed twice \(first at .*hosts:1\)"):
        parse_hostfile(hostfile(tmp_path, "a\na:2\n"))
    with pytest.raises(HostfileError, match="no hosts found"):
        parse_hostfile(hostfile(tmp_path, "# nothing\n\n"))
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "absent")


def test_host_list():
    assert parse_hosts("a:2,b") == [HostSlots("a", 2, None, "-H a:2,b"), HostSlots("b", 1, None, "-H a:2,b")]
    with pytest.raises(HostfileError, match="empty host entry"):
        parse_hosts("a:2,,b")


def test_shipped_hostfiles_parse():
    assert total_slots(parse_hostfile(ROOT / "hostfiles/localhost")) == 2
    assert total_slots(parse_hostfile(ROOT / "hostfiles/example-cluster")) == 16
