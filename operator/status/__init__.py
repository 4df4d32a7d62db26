"""Pure status logic, a module per policy: what the RLJob's status is, given what the operator observes.

No I/O here. The reconcile service (rljob.operator.reconcile) gathers the observations (the RLJob, a
projection of its JobSet, the newest pod failure, the trainer's progress report) into `Observed` and
calls `derive_status`, which returns the complete new status and the events to post after writing it.

A module per policy, as JobSet keeps a file per policy (the layers are checked by import-linter):
- views.py: the few fields of a JobSet the operator keeps (`JobSetView`), timestamps, owner references;
- pods.py: what a failed pod says (`classify_pod`) and what FailedCreate events say (`pod_create_error`);
- preflight.py: the compile preflight's Job and pod, and where it stands (`preflight_outcome`);
- observed.py: everything the status depends on (`Observed`);
- restarts.py: the restart budgets per role, the JobSet to stop, the last failure;
- phase.py: the phase, the conditions and the events (`derive_status`), the status body.

Rules (the tests in tests/operator/test_status.py are the table of cases):
- Terminal phases are latched: once Succeeded or Failed, the phase and terminal conditions never change
  and the operator never creates a JobSet again (also when the JobSet is later deleted by its TTL).
- A spec that does not parse or plan makes the run Failed (reason InvalidSpec, naming the field), unless its
  JobSet exists already (an operator upgrade that refuses what an older version admitted): then the run is
  tracked from its JobSet to its end, with Accepted=False (SpecNoLongerPlans) and a Warning event.
- A child that cannot be created (an API error, or an object of the same name this RLJob does not own)
  keeps the run Pending with Ready=False (CreateFailed, ChildNotOwned) and a Warning event; the reconcile
  retries with backoff. So does a Job of the run whose pods the API server refuses (Pod Security
  admission, a quota): the Job controller's FailedCreate event, read by the reconcile while the run
  waits for pods, is the message (PodCreateFailed), until the pods exist and are ready.
- The compile preflight (spec.trainer.preflight.compile): while its Job runs the run is Pending with
  Ready=False (PreflightCompiling) and no JobSet exists; a refusal (exit 2) keeps it Pending with Ready=False
  (CompileDoesNotFit, the refusal's lines from the pod's termination message) and a Warning event, any other
  failure likewise (PreflightFailed); the JobSet is created only after the Job succeeded. The outcome is kept
  in status.preflight, so a Job deleted by its TTL is not run again.
- A JobSet that disappears before its outcome was observed makes the run Failed (JobSetDeleted): the
  operator does not guess whether it finished, and never silently starts the run over.
- Restarts, per role (rljob.recipes.failure): the run's (a trainer crash restarts every Job) are the
  JobSet's restartsCountTowardsMax; the samplers' (a sampler crash restarts that sampler Job alone) are
  the sum of its replicatedJobsStatus[sampler].jobRestartsCountTowardsMax (JobSet >= v0.12.0). Restarts
  after preemption or maintenance (DisruptionTarget) are not counted. JobSet has one budget for both, so
  the operator holds each role to its own: a role past its budget makes the run Failed
  (RestartsExhausted, naming the budget) and the reconcile suspends the JobSet (its pods stop). The
  class and role of the last failure come from the failed pod when the operator saw it, otherwise from
  which JobSet counter moved.
"""
