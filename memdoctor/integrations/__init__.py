"""memdoctor where users train: transformers' Trainer and Lightning callbacks (one module
each, importing its framework only when imported itself) and `settings_for`, a Plan in each
framework's own settings.

    from memdoctor.integrations.transformers import MemdoctorCallback
    from memdoctor.integrations.lightning import MemdoctorCallback
    from memdoctor.integrations import settings_for
"""
from memdoctor.remedies.framework_settings import FRAMEWORKS, Settings, settings_for

__all__ = ["FRAMEWORKS", "Settings", "settings_for"]
