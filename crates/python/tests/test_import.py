import pagewire


def test_version_is_a_string():
    assert isinstance(pagewire.__version__, str)
