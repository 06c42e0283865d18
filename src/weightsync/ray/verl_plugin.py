"""Importing this module registers weightsync's checkpoint engine in verl's registry under
``weightsync`` (:func:`weightsync.ray.verl.register`).

verl imports it in two ways: as the ``verl.plugins`` entry point weightsync declares (``import
verl`` loads every installed plugin), and as ``checkpoint_engine.custom_backend_module``
where plugin loading is off (``VERL_USE_EXTERNAL_PLUGINS=none``).  Raises ``InvalidRequest``
(``missing_extra``) when verl cannot be imported.
"""

from __future__ import annotations

from weightsync.ray.verl import register

ENGINE = register()
