"""treadle.lang: structured generation programs in Python.

```python
from treadle.lang import function, gen, select, system, user, assistant, set_default_backend, EngineBackend

@function
def qa(s, question):
    s += user(question)
    s += assistant(gen("answer", max_tokens=64))

set_default_backend(EngineBackend(engine))
print(qa.run(question="What is the capital of France?", temperature=0)["answer"])
```

See docs/lang.md for the whole language.
"""

from treadle.lang.backend import Backend, Completion
from treadle.lang.engine_backend import EngineBackend
from treadle.lang.ir import assistant, gen, select, system, user
from treadle.lang.program import Program, function, get_default_backend, set_default_backend
from treadle.lang.runtime_endpoint import RuntimeEndpoint, RuntimeEndpointError
from treadle.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend",
    "Completion",
    "EngineBackend",
    "ForkGroup",
    "Program",
    "ProgramState",
    "RuntimeEndpoint",
    "RuntimeEndpointError",
    "assistant",
    "function",
    "gen",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "user",
]
