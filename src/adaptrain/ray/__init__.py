"""adaptrain on Ray: the service's Ray backend (:mod:`adaptrain.ray.backend`), the Tune trial
scheduler (:mod:`adaptrain.ray.tune`) and the elastic launcher behind ``adaptrain ray submit``
(:mod:`adaptrain.ray.launcher`). Each needs ``pip install adaptrain[ray]``; import the
submodule you use."""

__all__: list[str] = []
