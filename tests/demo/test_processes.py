from inferprof.demo.processes import _announced_port


def test_serve_announcement_parsing_ignores_other_output():
    assert _announced_port(b'{"port": 4242, "pid": 1}\n') == 4242
    assert _announced_port(b"some library printed this\n") is None
    assert _announced_port(b'{"other": 1}\n') is None
    assert _announced_port(b"") is None
