"""The `tensorboard_plugins` entry point: loads the dashboard, or steps aside.

TensorBoard stops if an entry point fails to import, so this module imports
only TensorBoard's plugin base, and a dashboard that fails to load is logged
and skipped instead of taking TensorBoard down with it.
"""

import logging

from tensorboard.plugins import base_plugin

logger = logging.getLogger(__name__)


class AccumulationPluginLoader(base_plugin.TBLoader):
    """Loads `AccumulationPlugin`; returns `None` (no tab) if it cannot."""

    def fix_flags(self, flags):
        """Keeps 1000 points per series unless `--samples_per_plugin` says.

        That is what TensorBoard keeps for scalars. Without it, the legacy
        loader (`--load_fast=false`) would keep only 10 per series of a
        third-party plugin.
        """
        try:
            from tfaccum import dashboard_schema

            samples = getattr(flags, "samples_per_plugin", None)
            if isinstance(samples, dict):
                samples.setdefault(dashboard_schema.PLUGIN_NAME, dashboard_schema.DEFAULT_SAMPLES)
        except Exception:  # noqa: BLE001 - never crash TensorBoard
            logger.exception("tb_plugin could not set its sampling default")

    def load(self, context):
        try:
            from tb_plugin.plugin import AccumulationPlugin

            return AccumulationPlugin(context)
        except Exception:  # noqa: BLE001 - never crash TensorBoard
            logger.exception(
                "The Accumulation dashboard (tb_plugin) failed to load; "
                "TensorBoard continues without it."
            )
            return None
