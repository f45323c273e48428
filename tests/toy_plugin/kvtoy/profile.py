"""The toy's profile for a worker whose ``load_model`` needs the weights (as vllm-metal's does):
its own ``init_device``, and its runner's model built without them. docs/plugins.md shows the
same shape for vllm-metal."""

from typing import Any, ClassVar

from kvtoy.runner import ToyModelRunner
from pytest_kvconform.backends.vllm.profiles.profile import PluginProfile, WorkerSteps


class ToyMetalProfile(PluginProfile):
    name: ClassVar[str] = "toy-metal-profile"
    platform: ClassVar[str] = "kvtoy.platform:ToyPlatform"
    worker: ClassVar[str] = "kvtoy.runner:WeightsRunnerWorker"
    steps: ClassVar[WorkerSteps] = WorkerSteps("own", "hook")

    def load_model(self, worker: Any, model: None) -> None:
        """The runner's ``load_model`` less its weights: the model from the config.json."""
        ToyModelRunner.load_model(worker.model_runner)
