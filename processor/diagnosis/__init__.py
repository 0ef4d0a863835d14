"""Step Time diagnosis: rules, gates, caps and issue order (docs/DIAGNOSIS.md).

`diagnose(window) -> StepTimeDiagnosis` is the one entry point; the live and the
summary profile both call it with `DEFAULT_POLICY`.
"""
from traceml.processor.diagnosis.api import diagnose, issue_order_key
from traceml.processor.diagnosis.policy import DEFAULT_POLICY, DiagnosisPolicy

__all__ = ["diagnose", "issue_order_key", "DEFAULT_POLICY", "DiagnosisPolicy"]
