import pytest

import inferprof
from tests.instrumentation.helpers import captured


@pytest.fixture
def cap():
    with captured() as c:
        yield c


@pytest.fixture(autouse=True)
def _unconfigured_after():
    yield
    inferprof.shutdown()
