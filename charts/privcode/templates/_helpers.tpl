{{/*
Naming, labels and the shared Ray cluster spec of the privcode chart.
*/}}

{{/* The chart name (nameOverride wins), at most 63 characters. */}}
{{- define "privcode.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name prefix of every resource: fullnameOverride, else <release>-<name>, or the release
name alone when it already contains the chart name. At most 63 characters (DNS label).
*/}}
{{- define "privcode.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A name made of the full name and a suffix, <fullname>-<suffix>, with the full name truncated
first so that the whole stays within 63 characters and the suffix keeps names distinct.
Usage: include "privcode.suffixedName" (list . "grafana")
*/}}
{{- define "privcode.suffixedName" -}}
{{- $root := index . 0 }}
{{- $suffix := index . 1 }}
{{- $base := include "privcode.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $base $suffix }}
{{- end }}

{{/*
The name of the Ray custom resources. KubeRay limits RayCluster names to 53 characters and
RayJob / RayService names to 47 (it appends a 6-character suffix to name their clusters), and
requires DNS-1035 labels (a lowercase letter first). The RayCluster and the RayJob are named
<rayName>, the RayService <rayName>-serve (so its <name>-head-svc never collides with the
RayCluster's), hence at most 41 characters here.
*/}}
{{- define "privcode.rayName" -}}
{{- $name := include "privcode.fullname" . | trunc 41 | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "Ray resource name %q is not a DNS-1035 label (KubeRay requires a lowercase letter first, then lowercase letters, digits or '-'): use a release name starting with a letter, or set fullnameOverride" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* Chart label value: <name>-<version>. */}}
{{- define "privcode.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels of every object. */}}
{{- define "privcode.labels" -}}
helm.sh/chart: {{ include "privcode.chart" . }}
{{ include "privcode.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: privcode
{{- end }}

{{/* Selector labels: every pod of the release carries them (the NetworkPolicy selects them). */}}
{{- define "privcode.selectorLabels" -}}
app.kubernetes.io/name: {{ include "privcode.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The role label of every pod of the release; the NetworkPolicies select pods by it:
pipeline (RayCluster and RayJob cluster pods), submitter (the RayJob's submitter), serving
(RayService cluster pods), executor (the sandbox executor, the only pods running generated code),
ledger (the privacy store's ledger service, the store's one writer).
*/}}
{{- define "privcode.roleKey" -}}
privcode.io/role
{{- end }}

{{/* Selector labels of the pods of one role. Usage: include "privcode.roleSelector" (list . "executor") */}}
{{- define "privcode.roleSelector" -}}
{{ include "privcode.selectorLabels" (index . 0) }}
{{ include "privcode.roleKey" (index . 0) }}: {{ index . 1 }}
{{- end }}

{{/* The sandbox executor's Deployment, Service and ServiceAccount. */}}
{{- define "privcode.executorName" -}}
{{- include "privcode.suffixedName" (list . "executor") }}
{{- end }}

{{/*
Whether the executor is rendered: enabled, and some pipeline cluster (RayJob or RayCluster) may
send it code; a serving-only release runs no generated code and gets no root pod.
*/}}
{{- define "privcode.executorRendered" -}}
{{- if and .Values.executor.enabled (include "privcode.pipelineRendered" .) }}true{{ end }}
{{- end }}

{{/*
"true" when pipeline Ray pods may run in the release: the chart's RayJob (job.enabled), the
long-lived RayCluster (cluster.enabled) or the RayJobs the operator makes from its template
(operator.enabled). Their NetworkPolicies and the executor are rendered then.
*/}}
{{- define "privcode.pipelineRendered" -}}
{{- if or .Values.job.enabled .Values.cluster.enabled .Values.operator.enabled }}true{{ end }}
{{- end }}

{{/*
The executor's namespace: executor.namespace, else <release namespace>-executor. The executor
needs capabilities (Pod Security `privileged`); a namespace of its own lets the release's
namespace, where every Ray pod runs, enforce `restricted`.
*/}}
{{- define "privcode.executorNamespace" -}}
{{- default (printf "%s-executor" .Release.Namespace) .Values.executor.namespace | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The executor's URL as the Ray pods see it: http://<name>.<executor namespace>.svc:<port>. */}}
{{- define "privcode.executorUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "privcode.executorName" .) (include "privcode.executorNamespace" .) (int .Values.executor.port) }}
{{- end }}

{{/*
The executor's bearer token: Secret <fullname>-executor-token (key `token`), generated once and
copied into the executor's namespace. Mounted read-only at this directory in the executor pods
and the pipeline's Ray pods only (never serving pods, the submitter or the autoscaler).
*/}}
{{- define "privcode.executorTokenSecret" -}}
{{- include "privcode.suffixedName" (list . "executor-token") }}
{{- end }}

{{- define "privcode.executorTokenDir" -}}
/var/run/privcode/executor-token
{{- end }}

{{/*
A Kubernetes quantity in MiB, rounded down (the executor's --memory-budget-mb and
--disk-budget-mb). Usage: include "privcode.quantityMiB" (list "4Gi" "executor.resources.limits.memory")
*/}}
{{- define "privcode.quantityMiB" -}}
{{- $q := toString (index . 0) }}
{{- $where := index . 1 }}
{{- $number := regexFind "^[+]?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?" $q }}
{{- $suffix := trimPrefix $number $q }}
{{- $mult := dict "" 1.0 "n" 1e-9 "u" 1e-6 "m" 1e-3 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- if or (not $number) (not (hasKey $mult $suffix)) }}
{{- fail (printf "%s: %q is not a memory quantity the chart can read (e.g. 4Gi, 4096Mi, 4G)" $where $q) }}
{{- end }}
{{- divf (mulf (float64 (trimPrefix "+" $number)) (get $mult $suffix)) 1048576.0 | floor | int64 }}
{{- end }}

{{/*
The environment that keeps generated code out of a pod holding private data (Ray pods, their
autoscaler, the job submitter): the executor's URL, and PRIVCODE_SANDBOX_FORBID_LOCAL=1 (the
application then refuses to run generated code in the pod). Nothing when executor.enabled=false
(sandbox.runInRayPods: the Ray pods run the code themselves).
*/}}
{{- define "privcode.sandboxEnv" -}}
{{- if .Values.executor.enabled }}
- name: PRIVCODE_SANDBOX_EXECUTOR
  value: {{ include "privcode.executorUrl" . | quote }}
- name: PRIVCODE_SANDBOX_FORBID_LOCAL
  value: "1"
{{- end }}
{{- end }}

{{/* The ServiceAccount Ray pods run as. */}}
{{- define "privcode.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "privcode.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The container image, tag defaulting to the appVersion. */}}
{{- define "privcode.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{- define "privcode.configMapName" -}}
{{- include "privcode.suffixedName" (list . "pipeline") }}
{{- end }}

{{- define "privcode.pvcName" -}}
{{- if .Values.storage.pvc.existingClaim }}
{{- .Values.storage.pvc.existingClaim }}
{{- else }}
{{- include "privcode.suffixedName" (list . "artifacts") }}
{{- end }}
{{- end }}

{{- define "privcode.storePvcName" -}}
{{- if .Values.storage.privacyStore.existingClaim }}
{{- .Values.storage.privacyStore.existingClaim }}
{{- else }}
{{- include "privcode.suffixedName" (list . "privacy-store") }}
{{- end }}
{{- end }}

{{- define "privcode.pacStatePvcName" -}}
{{- if .Values.storage.pacState.existingClaim }}
{{- .Values.storage.pacState.existingClaim }}
{{- else }}
{{- include "privcode.suffixedName" (list . "pac-state") }}
{{- end }}
{{- end }}

{{/* The claim of the training data (storage.data): existingClaim, else <fullname>-data. */}}
{{- define "privcode.dataPvcName" -}}
{{- if .Values.storage.data.existingClaim }}
{{- .Values.storage.data.existingClaim }}
{{- else }}
{{- include "privcode.suffixedName" (list . "data") }}
{{- end }}
{{- end }}

{{/* The claim of the model weights (storage.models): existingClaim, else <fullname>-models. */}}
{{- define "privcode.modelsPvcName" -}}
{{- if .Values.storage.models.existingClaim }}
{{- .Values.storage.models.existingClaim }}
{{- else }}
{{- include "privcode.suffixedName" (list . "models") }}
{{- end }}
{{- end }}

{{/*
"true" when two absolute paths are the same directory or one lies inside the other (a mount
there would hide, or be hidden by, the other), else "". Usage: include "privcode.pathsOverlap"
(list a b)
*/}}
{{- define "privcode.pathsOverlap" -}}
{{- $a := printf "%s/" (trimSuffix "/" (index . 0)) }}
{{- $b := printf "%s/" (trimSuffix "/" (index . 1)) }}
{{- if or (hasPrefix $a $b) (hasPrefix $b $a) }}true{{ end }}
{{- end }}

{{/* The privacy store's directory on its own claim: <storage.privacyStore.mountPath>/store. */}}
{{- define "privcode.storePath" -}}
{{- printf "%s/store" (trimSuffix "/" .Values.storage.privacyStore.mountPath) }}
{{- end }}

{{/*
"true" when the privacy store's ledger service runs (ledger.enabled, with the store on its own
claim, storage.privacyStore.enabled), else "". Then the ledger Deployment is the store's one
writer: the pipeline's Ray pods mount the store read-only and call the service with the
pipeline token, the serving pods hold no store at all (the serving token: PAC calls only).
Else every Ray pod mounts the store read-write (the single-cluster fallback).
*/}}
{{- define "privcode.ledgerEnabled" -}}
{{- if and .Values.ledger.enabled .Values.storage.privacyStore.enabled }}true{{ end }}
{{- end }}

{{/* The ledger's Deployment, Service, ServiceAccount and NetworkPolicy. */}}
{{- define "privcode.ledgerName" -}}
{{- include "privcode.suffixedName" (list . "ledger") }}
{{- end }}

{{/* The Secret of the ledger's bearer tokens: ledger.existingSecret, else the chart's. */}}
{{- define "privcode.ledgerSecretName" -}}
{{- if .Values.ledger.existingSecret }}
{{- .Values.ledger.existingSecret }}
{{- else }}
{{- include "privcode.suffixedName" (list . "ledger-tokens") }}
{{- end }}
{{- end }}

{{/* The ledger's URL as the Ray pods see it: http://<name>.<namespace>.svc:<port>. */}}
{{- define "privcode.ledgerUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "privcode.ledgerName" .) .Release.Namespace (int .Values.ledger.port) }}
{{- end }}

{{/*
Where a Ray pod finds its role's ledger token (one file, named after the role: a projected
volume holding only that key of the Secret).
*/}}
{{- define "privcode.ledgerTokenDir" -}}
/etc/privcode/ledger-token
{{- end }}

{{/* The operator's Deployment, ServiceAccount, Role, RoleBinding and NetworkPolicy. */}}
{{- define "privcode.operatorName" -}}
{{- include "privcode.suffixedName" (list . "operator") }}
{{- end }}

{{/* The namespaces the operator watches, as a JSON list: operator.namespaces, else the release's. */}}
{{- define "privcode.operatorNamespaces" -}}
{{- default (list .Release.Namespace) .Values.operator.namespaces | uniq | toJson }}
{{- end }}

{{/*
The claims no RayJob may mount unless a PrivCodeRun owns it (the admission policy), as a JSON
list: the privacy store's claim, operator.dataClaims and the chart's own data claim
(storage.data, mounted only by the chart's RayJob, which the policy exempts by name).
*/}}
{{- define "privcode.protectedClaims" -}}
{{- $claims := concat (list (include "privcode.storePvcName" .)) .Values.operator.dataClaims }}
{{- if .Values.storage.data.enabled }}
{{- $claims = append $claims (include "privcode.dataPvcName" .) }}
{{- end }}
{{- $claims | uniq | toJson }}
{{- end }}

{{/*
The name of the cluster-scoped admission policy and its binding: <fullname>-<namespace>-rayjob-claims
(two releases of the same name in two namespaces get two), shortened with a hash to 63 characters.
*/}}
{{- define "privcode.admissionPolicyName" -}}
{{- $base := printf "%s-%s" (include "privcode.fullname" .) .Release.Namespace }}
{{- $suffix := "rayjob-claims" }}
{{- if le (len (printf "%s-%s" $base $suffix)) 63 }}
{{- printf "%s-%s" $base $suffix }}
{{- else }}
{{- $hash := printf "%s/%s" .Release.Namespace (include "privcode.fullname" .) | sha256sum | trunc 8 }}
{{- $keep := int (sub 63 (add (len $suffix) 10)) }}
{{- printf "%s-%s-%s" ($base | trunc $keep | trimSuffix "-") $hash $suffix }}
{{- end }}
{{- end }}

{{/*
What the serving pods see of the artifacts volume, as a JSON list of paths relative to
storage.mountPath (read-only subPath mounts): serve.artifactPaths, and the directories the
enabled apps' args name there (premium: args.premium, args.model; ensemble: args.worlds,
args.model). Never the whole volume: it holds the private corpus, the runs' non-DP stages and
the owner-only reports. Nested paths collapse into the outer one. Empty without the PVC.
*/}}
{{- define "privcode.servingArtifactPaths" -}}
{{- $m := printf "%s/" (include "privcode.mountPath" . | trimSuffix "/") }}
{{- $paths := list }}
{{- range .Values.serve.artifactPaths }}
{{- $paths = append $paths (trimSuffix "/" (trimPrefix "/" .)) }}
{{- end }}
{{- range $key, $arg := dict "premium" (list "premium" "model") "ensemble" (list "worlds" "model") }}
{{- $app := index $.Values.serve $key }}
{{- if $app.enabled }}
{{- range $arg }}
{{- $p := toString (get (default (dict) $app.args) .) }}
{{- if hasPrefix $m $p }}
{{- $paths = append $paths (trimSuffix "/" (trimPrefix $m $p)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $kept := list }}
{{- range $p := $paths | uniq | sortAlpha }}
{{- if or (not $p) (has ".." (splitList "/" $p)) }}
{{- fail (printf "serve: %q is not a path inside storage.mountPath (the serving pods mount directories of the artifacts volume, never the whole volume or anything above it)" $p) }}
{{- end }}
{{- $inside := false }}
{{- range $kept }}
{{- if hasPrefix (printf "%s/" .) $p }}{{ $inside = true }}{{ end }}
{{- end }}
{{- if not $inside }}
{{- $kept = append $kept $p }}
{{- end }}
{{- end }}
{{- if not .Values.storage.pvc.enabled }}
{{- $kept = list }}
{{- end }}
{{- $kept | toJson }}
{{- end }}

{{/* The artifacts mount path without a trailing slash. */}}
{{- define "privcode.mountPath" -}}
{{- $p := trimSuffix "/" .Values.storage.mountPath }}
{{- default "/" $p }}
{{- end }}

{{/*
POSIX shell quoting of one word, like Python's shlex.quote: safe words stay as they are,
anything else is single-quoted with embedded single quotes escaped.
*/}}
{{- define "privcode.shquote" -}}
{{- $s := toString . }}
{{- if regexMatch "^[A-Za-z0-9_@%+=:,./-]+$" $s }}
{{- $s }}
{{- else }}
{{- printf "'%s'" (replace "'" "'\"'\"'" $s) }}
{{- end }}
{{- end }}

{{/* The RayJob entrypoint: job.entrypoint verbatim, else jobs/pipeline.py with the overrides. */}}
{{- define "privcode.entrypoint" -}}
{{- if .Values.job.entrypoint }}
{{- .Values.job.entrypoint }}
{{- else }}
{{- $m := include "privcode.mountPath" . | trimSuffix "/" }}
{{- $args := list "python" "/app/jobs/pipeline.py" "--config" "/etc/privcode/pipeline.yaml" }}
{{- $args = concat $args (list "--set" (printf "run.out_dir=%s/runs" $m)) }}
{{- $args = concat $args (list "--set" (printf "run.reports_dir=%s/reports" $m)) }}
{{- $args = concat $args (list "--set" (printf "base.cache_dir=%s/cache" $m)) }}
{{- /* the isolation the executor runs at (privcode.validate refuses it in pipeline.overrides) */}}
{{- $args = concat $args (list "--set" (printf "sandbox.isolation=%s" .Values.executor.isolation)) }}
{{- range .Values.pipeline.overrides }}
{{- $args = concat $args (list "--set" .) }}
{{- end }}
{{- $quoted := list }}
{{- range $args }}
{{- $quoted = append $quoted (include "privcode.shquote" .) }}
{{- end }}
{{- join " " $quoted }}
{{- end }}
{{- end }}

{{/*
Checks of values that the JSON schema cannot express; every template that renders Ray pods
includes it, so a bad combination fails the whole rendering with a clear message.
*/}}
{{- define "privcode.validate" -}}
{{- $vllm := include "privcode.premiumVllm" . }}
{{- range $group, $g := .Values.workerGroups }}
{{- if or $g.enabled (and $vllm (eq $group "gpu")) }}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) }}
{{- fail (printf "workerGroups.%s: minReplicas (%d) > maxReplicas (%d)" $group (int $g.minReplicas) (int $g.maxReplicas)) }}
{{- end }}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) }}
{{- fail (printf "workerGroups.%s: replicas (%d) must be between minReplicas (%d) and maxReplicas (%d)" $group (int $g.replicas) (int $g.minReplicas) (int $g.maxReplicas)) }}
{{- end }}
{{- if hasKey (default (dict) $g.rayStartParams) "labels" }}
{{- fail (printf "workerGroups.%s.rayStartParams: 'labels' is not supported by KubeRay (it fails the RayCluster); remove it" $group) }}
{{- end }}
{{- end }}
{{- end }}
{{- if hasKey (default (dict) .Values.head.rayStartParams) "labels" }}
{{- fail "head.rayStartParams: 'labels' is not supported by KubeRay (it fails the RayCluster); remove it" }}
{{- end }}
{{- if and (eq .Values.auth.mode "token") (not (semverCompare ">=2.52.0-0" .Values.rayVersion)) }}
{{- fail (printf "auth.mode=token needs Ray >= 2.52.0 but rayVersion is %s: upgrade the image or set auth.mode=disabled" .Values.rayVersion) }}
{{- end }}
{{- if and .Values.job.enabled (not .Values.storage.pvc.enabled) (not .Values.storage.objectStore.uri) }}
{{- fail "job.enabled: the RayJob has nowhere to keep its artifacts (storage.pvc.enabled=false and storage.objectStore.uri is empty): enable the PVC, set storage.pvc.existingClaim, or set storage.objectStore.uri" }}
{{- end }}
{{- /* where generated code runs: the executor, or (acknowledged by name) the Ray pods */}}
{{- if not .Values.executor.enabled }}
{{- if not .Values.sandbox.runInRayPods }}
{{- fail "executor.enabled=false: the Ray pods would run model-generated code themselves, in the pods that hold the private corpus, the privacy store (budgets, ledger, fingerprint keys), the artifacts and the Ray auth token. Keep executor.enabled=true, or accept that risk by name with sandbox.runInRayPods=true (unsafe)" }}
{{- end }}
{{- $caps := default (list) (dig "capabilities" "add" (list) (default (dict) .Values.securityContext)) }}
{{- if and (eq .Values.executor.isolation "full") (not (has "SYS_ADMIN" $caps)) }}
{{- fail "sandbox.runInRayPods=true with executor.isolation=full: the Ray containers run without the capabilities the full sandbox needs (non-root, all capabilities dropped), so the pipeline would refuse to run any snippet. Set executor.isolation=rlimits-only (weak: verdicts only, no protection) or enable the executor" }}
{{- end }}
{{- end }}
{{- $reserved := list "PRIVCODE_SANDBOX_EXECUTOR" "PRIVCODE_SANDBOX_FORBID_LOCAL" "PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE" }}
{{- range $where, $env := dict "extraEnv" .Values.extraEnv "head.env" .Values.head.env "autoscaling.autoscalerOptions.env" .Values.autoscaling.autoscalerOptions.env }}
{{- range $env }}
{{- if has .name $reserved }}
{{- fail (printf "%s sets %s: the chart sets it from executor.* (it decides where generated code may run); remove it" $where .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $_ := (dig "env_vars" (dict) (default (dict) .Values.job.runtimeEnv)) }}
{{- if has $name $reserved }}
{{- fail (printf "job.runtimeEnv.env_vars sets %s: the chart sets it from executor.* (it decides where generated code may run); remove it" $name) }}
{{- end }}
{{- end }}
{{- if include "privcode.ledgerEnabled" . }}
{{- $ledgerEnv := list "PRIVCODE_LEDGER_URL" "PRIVCODE_LEDGER_TOKEN_FILE" }}
{{- range $where, $env := dict "extraEnv" .Values.extraEnv "head.env" .Values.head.env }}
{{- range $env }}
{{- if has .name $ledgerEnv }}
{{- fail (printf "%s sets %s: the chart sets it from ledger.* (which ledger the pods call, with which role's token); remove it" $where .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $_ := (dig "env_vars" (dict) (default (dict) .Values.job.runtimeEnv)) }}
{{- if has $name $ledgerEnv }}
{{- fail (printf "job.runtimeEnv.env_vars sets %s: the chart sets it from ledger.* (which ledger the pods call, with which role's token); remove it" $name) }}
{{- end }}
{{- end }}
{{- if and .Values.serve.enabled .Values.serve.ensemble.enabled }}
{{- $e := default (dict) .Values.serve.ensemble.args }}
{{- if get $e "privacy_store" }}
{{- fail "serve.ensemble.args.privacy_store is set, but with ledger.enabled the serving pods hold no privacy store: the ensemble calls the store's ledger service (args.ledger, default the chart's) and keeps its curator state on storage.pacState. Leave privacy_store empty, or set ledger.enabled=false (the single-cluster fallback: every Ray pod mounts the store)" }}
{{- end }}
{{- if hasPrefix "privcode-store:" (toString (get $e "ledger")) }}
{{- fail (printf "serve.ensemble.args.ledger is the ledger actor %q, but with ledger.enabled no pod of the serving cluster holds the store (no actor runs there): leave it empty for the chart's ledger service, or set an http(s) URL" (get $e "ledger")) }}
{{- end }}
{{- if and (not .Values.storage.pacState.enabled) (not (get $e "pac_state")) }}
{{- fail "serve.ensemble with ledger.enabled: the curator state needs a volume of its own (the serving pods hold no privacy store): keep storage.pacState.enabled=true, or set serve.ensemble.args.pac_state to a persistent directory the serving pods mount" }}
{{- end }}
{{- end }}
{{- end }}
{{- /* the Ray dashboard's Grafana / Prometheus variables come from metrics.* when set there */}}
{{- $metricsEnv := dict "RAY_GRAFANA_HOST" .Values.metrics.grafanaHost "RAY_PROMETHEUS_HOST" .Values.metrics.prometheusHost "RAY_GRAFANA_IFRAME_HOST" .Values.metrics.grafanaIframeHost }}
{{- range $where, $env := dict "extraEnv" .Values.extraEnv "head.env" .Values.head.env }}
{{- range $env }}
{{- if get $metricsEnv .name }}
{{- fail (printf "%s sets %s, which the chart sets on the heads from metrics.* (grafanaHost, prometheusHost, grafanaIframeHost): set it in one place" $where .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- include "privcode.validateMounts" . }}
{{- range .Values.pipeline.overrides }}
{{- if or (hasPrefix "sandbox.isolation=" .) (hasPrefix "sandbox.executor=" .) }}
{{- fail (printf "pipeline.overrides: %q: the chart sets sandbox.isolation from executor.isolation and the executor's address from executor.*; set those instead" .) }}
{{- end }}
{{- end }}
{{- if and .Values.serve.enabled (not .Values.serve.premium.enabled) (not .Values.serve.ensemble.enabled) }}
{{- fail "serve.enabled: no Serve application is enabled: set serve.premium.enabled=true and/or serve.ensemble.enabled=true (or serve.enabled=false)" }}
{{- end }}
{{- if and .Values.serve.enabled .Values.serve.premium.enabled .Values.serve.ensemble.enabled (eq .Values.serve.premium.routePrefix .Values.serve.ensemble.routePrefix) }}
{{- fail (printf "serve: premium and ensemble have the same routePrefix %q; give each application its own" .Values.serve.premium.routePrefix) }}
{{- end }}
{{- if and .Values.serve.enabled (not .Values.apiKey.existingSecret) }}
{{- fail "serve.enabled: apiKey.existingSecret is empty, and the serving applications refuse to start without an API key. Create a Secret with one key per client (the key's name is the client, its value that client's API key), e.g.\n  kubectl create secret generic privcode-api-keys --from-literal=<client>=$(openssl rand -hex 32)\nand set apiKey.existingSecret=privcode-api-keys" }}
{{- end }}
{{- if and .Values.serve.enabled .Values.serve.ensemble.enabled }}
{{- $e := default (dict) .Values.serve.ensemble.args }}
{{- $perKey := get $e "max_sessions_per_key" }}
{{- $all := get $e "max_sessions" }}
{{- if and (not (kindIs "string" $perKey)) (not (kindIs "string" $all)) (not (kindIs "invalid" $perKey)) (not (kindIs "invalid" $all)) }}
{{- if gt (float64 $perKey) (float64 $all) }}
{{- fail (printf "serve.ensemble.args: max_sessions_per_key (%v) is larger than max_sessions (%v)" $perKey $all) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $vllm }}
{{- $v := default (dict) .Values.serve.premium.vllm }}
{{- $min := get $v "vllm_min_replicas" }}
{{- $max := get $v "vllm_max_replicas" }}
{{- if and (not (kindIs "string" $min)) (not (kindIs "string" $max)) (not (kindIs "invalid" $min)) (not (kindIs "invalid" $max)) }}
{{- if gt (float64 $min) (float64 $max) }}
{{- fail (printf "serve.premium.vllm: vllm_min_replicas (%v) is larger than vllm_max_replicas (%v)" $min $max) }}
{{- end }}
{{- end }}
{{- $gpus := get (default (dict) .Values.serve.premium.rayActorOptions) "num_gpus" }}
{{- if and (eq .Values.serve.premium.deploymentName "PremiumServer") (gt (float64 $gpus) 0.0) }}
{{- fail (printf "serve.premium.rayActorOptions.num_gpus is %v but serve.premium.args.engine=vllm: PremiumServer is then only the CPU ingress (set num_gpus: 0); the vLLM replicas take their GPUs (vllm_tensor_parallel_size each) from the gpu worker group" $gpus) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The data and models claims (storage.data, storage.models) each get a directory of their own on
the Ray pods: neither may be, hold or lie inside another mount of those pods (the artifacts,
the privacy store, the PAC state, /tmp, /etc/privcode, /dev/shm, /app) or the other claim, and
with the operator, the models claim (on its runs' pods too) must stay out of operator.dataRoot,
where the operator mounts each run's data claim. storage.data never meets operator.dataRoot on
one pod (the operator's runs do not get it), so both may be /mnt/data.
*/}}
{{- define "privcode.validateMounts" -}}
{{- $s := .Values.storage }}
{{- $taken := list (list "storage.mountPath" (include "privcode.mountPath" .)) (list "/tmp (Ray's emptyDir)" "/tmp") (list "/etc/privcode (the pipeline config)" "/etc/privcode") (list "/dev/shm" "/dev/shm") (list "/app (the image's privcode)" "/app") }}
{{- if $s.privacyStore.enabled }}
{{- $taken = append $taken (list "storage.privacyStore.mountPath" $s.privacyStore.mountPath) }}
{{- end }}
{{- if and .Values.serve.enabled .Values.serve.ensemble.enabled $s.pacState.enabled }}
{{- $taken = append $taken (list "storage.pacState.mountPath" $s.pacState.mountPath) }}
{{- end }}
{{- range $key := list "data" "models" }}
{{- $claim := index $s $key }}
{{- if $claim.enabled }}
{{- range $taken }}
{{- if include "privcode.pathsOverlap" (list $claim.mountPath (index . 1)) }}
{{- fail (printf "storage.%s.mountPath %q overlaps %s (%q): give the %s claim a directory of its own" $key $claim.mountPath (index . 0) (index . 1) $key) }}
{{- end }}
{{- end }}
{{- $taken = append $taken (list (printf "storage.%s.mountPath" $key) $claim.mountPath) }}
{{- end }}
{{- end }}
{{- if and .Values.operator.enabled $s.models.enabled (include "privcode.pathsOverlap" (list $s.models.mountPath .Values.operator.dataRoot)) }}
{{- fail (printf "storage.models.mountPath %q overlaps operator.dataRoot %q, where the operator mounts each run's data claim (<dataRoot>/<claim>) beside the models: move one of them" $s.models.mountPath .Values.operator.dataRoot) }}
{{- end }}
{{- end }}

{{/*
"true" when the RayService serves the premium model with vLLM (serve.premium.args.engine: vllm,
Ray Serve LLM), else "". Its cluster then has the gpu worker group, workerGroups.gpu.enabled or
not, and serve.premium.vllm is merged into the premium app's args.
*/}}
{{- define "privcode.premiumVllm" -}}
{{- $p := .Values.serve.premium }}
{{- if and .Values.serve.enabled $p.enabled (eq (toString (dig "engine" "" (default (dict) $p.args))) "vllm") }}true{{ end }}
{{- end }}

{{/* Checksum of the pipeline config: a new config gives new pod templates. */}}
{{- define "privcode.configChecksum" -}}
{{- printf "%s\n%s" .Values.pipeline.config (join "\n" .Values.pipeline.overrides) | sha256sum }}
{{- end }}

{{/* The /tmp emptyDir volume (Ray's /tmp/ray, HOME and caches with a read-only root). */}}
{{- define "privcode.tmpVolume" -}}
- name: tmp
  emptyDir:
    {{- if .Values.storage.tmp.sizeLimit }}
    sizeLimit: {{ .Values.storage.tmp.sizeLimit | quote }}
    {{- else }} {}
    {{- end }}
{{- end }}

{{/*
Where the RayService's Ray containers mount apiKey.existingSecret (PRIVCODE_API_KEYS_DIR): one
file per Secret key, the file name being the client, its content that client's key.
*/}}
{{- define "privcode.apiKeysDir" -}}
/etc/privcode/api-keys
{{- end }}

{{/*
Environment of every Ray container. Input: dict "root" . "kind" (head|worker) "serving" bool.
*/}}
{{- define "privcode.rayEnv" -}}
{{- $root := .root }}
{{- $m := include "privcode.mountPath" $root | trimSuffix "/" }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: MPLCONFIGDIR
  value: /tmp/.config/matplotlib
- name: HF_HOME
  value: {{ printf "%s/cache/huggingface" $m | quote }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: RAY_DATA_USAGE_DISABLED
  value: "1"
- name: OMP_WAIT_POLICY
  value: PASSIVE
{{- $ledger := include "privcode.ledgerEnabled" $root }}
{{- /* with the ledger service, the serving pods hold no store (no volume, no variable) */}}
{{- if and $root.Values.storage.privacyStore.enabled (not (and .serving $ledger)) }}
- name: PRIVCODE_PRIVACY_STORE
  value: {{ include "privcode.storePath" $root | quote }}
{{- end }}
{{- if $ledger }}
- name: PRIVCODE_LEDGER_URL
  value: {{ include "privcode.ledgerUrl" $root | quote }}
- name: PRIVCODE_LEDGER_TOKEN_FILE
  value: {{ printf "%s/%s" (include "privcode.ledgerTokenDir" $root) (ternary "serving" "pipeline" .serving) | quote }}
{{- end }}
{{- if $root.Values.storage.objectStore.uri }}
- name: PRIVCODE_OBJECT_STORE_URI
  value: {{ $root.Values.storage.objectStore.uri | quote }}
{{- end }}
{{- if and .serving $root.Values.apiKey.existingSecret }}
- name: PRIVCODE_API_KEYS_DIR
  value: {{ include "privcode.apiKeysDir" $root | quote }}
{{- end }}
{{- if eq .kind "head" }}
{{- /* the Ray dashboard's Metrics tab: where its backend and your browser find Grafana / Prometheus */}}
{{- with $root.Values.metrics.grafanaHost }}
- name: RAY_GRAFANA_HOST
  value: {{ . | quote }}
{{- end }}
{{- with $root.Values.metrics.prometheusHost }}
- name: RAY_PROMETHEUS_HOST
  value: {{ . | quote }}
{{- end }}
{{- with $root.Values.metrics.grafanaIframeHost }}
- name: RAY_GRAFANA_IFRAME_HOST
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if and (eq .kind "head") $root.Values.head.env }}
{{ toYaml $root.Values.head.env }}
{{- end }}
{{- with $root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with include "privcode.sandboxEnv" $root }}
{{ . | trim }}
{{- end }}
{{- if and (not .serving) (include "privcode.executorRendered" $root) }}
- name: PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE
  value: {{ printf "%s/token" (include "privcode.executorTokenDir" $root) | quote }}
{{- end }}
{{- end }}

{{/*
The pod template of a Ray node (head or one worker group).
Input: dict "root" . "kind" (head|worker) "group" <values of the group> "groupName" name
"serving" bool "operatorTemplate" bool (the operator's RayJob template: no storage.data, its
runs get their own data claim).
*/}}
{{- define "privcode.rayPodTemplate" -}}
{{- $root := .root }}
{{- $g := .group }}
{{- $isHead := eq .kind "head" }}
{{- $ledger := include "privcode.ledgerEnabled" $root }}
{{- $role := ternary "serving" "pipeline" .serving }}
{{- /* the store: read-only on the pipeline pods with the ledger service, none on the serving pods */}}
{{- $store := and $root.Values.storage.privacyStore.enabled (not (and .serving $ledger)) }}
{{- $pacState := and .serving $root.Values.storage.pacState.enabled $root.Values.serve.ensemble.enabled }}
{{- /* the chart's training data: pipeline pods of the chart's own runs only */}}
{{- $data := and $root.Values.storage.data.enabled (not .serving) (not .operatorTemplate) }}
{{- /* public model weights: every pipeline pod, the serving pods with storage.models.serving */}}
{{- $models := and $root.Values.storage.models.enabled (or (not .serving) $root.Values.storage.models.serving) }}
{{- $runtimeClass := default $root.Values.sandbox.runtimeClassName $g.runtimeClassName }}
{{- /* the executor's token: the pipeline pods only (they send it code) */}}
{{- $executorToken := and (not .serving) (include "privcode.executorRendered" $root) }}
{{- /* the serving pods see only the release's paths of the artifacts volume, read-only */}}
{{- $servingPaths := list }}
{{- if .serving }}
{{- $servingPaths = include "privcode.servingArtifactPaths" $root | fromJsonArray }}
{{- end }}
{{- $resources := deepCopy (default (dict) $g.resources) }}
{{- if and (not $isHead) (hasKey $g "gpusPerWorker") }}
{{- $gpus := toString (int $g.gpusPerWorker) }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default (dict) $resources.limits)) }}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" $gpus) (default (dict) $resources.requests)) }}
{{- end }}
metadata:
  labels:
    {{- include "privcode.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ ternary "ray-head" "ray-worker" $isHead }}
    {{ include "privcode.roleKey" $root }}: {{ if .serving }}serving{{ else }}pipeline{{ end }}
    {{- if not $isHead }}
    privcode/worker-group: {{ .groupName }}
    {{- end }}
  annotations:
    checksum/pipeline: {{ include "privcode.configChecksum" $root }}
    {{- if and $root.Values.metrics.scrapeAnnotations (not $root.Values.metrics.podMonitor.enabled) }}
    # Ray's metrics (privcode's included) for a Prometheus that finds pods by annotation.
    prometheus.io/scrape: "true"
    prometheus.io/port: "8080"
    prometheus.io/path: /metrics
    {{- end }}
spec:
  serviceAccountName: {{ include "privcode.serviceAccountName" $root }}
  automountServiceAccountToken: {{ or $root.Values.serviceAccount.automountServiceAccountToken (and $isHead $root.Values.autoscaling.enableInTreeAutoscaling) }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $runtimeClass }}
  runtimeClassName: {{ $runtimeClass }}
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" $isHead }}
      image: {{ include "privcode.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      workingDir: /app
      {{- with $root.Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        {{- if $isHead }}
        - name: gcs-server
          containerPort: 6379
          protocol: TCP
        - name: dashboard
          containerPort: 8265
          protocol: TCP
        - name: client
          containerPort: 10001
          protocol: TCP
        - name: serve
          containerPort: {{ int $root.Values.serve.port }}
          protocol: TCP
        # the dashboard's own metrics (and the autoscaler sidecar's): the PodMonitor's endpoints
        - name: dash-metrics
          containerPort: 44227
          protocol: TCP
        {{- if $root.Values.autoscaling.enableInTreeAutoscaling }}
        - name: as-metrics
          containerPort: 44217
          protocol: TCP
        {{- end }}
        {{- end }}
        - name: metrics
          containerPort: 8080
          protocol: TCP
      env:
        {{- include "privcode.rayEnv" (dict "root" $root "kind" .kind "serving" .serving) | trim | nindent 8 }}
      {{- if $root.Values.storage.objectStore.secretName }}
      envFrom:
        - secretRef:
            name: {{ $root.Values.storage.objectStore.secretName | quote }}
      {{- end }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: pipeline-config
          mountPath: /etc/privcode
          readOnly: true
        {{- if not .serving }}
        - name: artifacts
          mountPath: {{ include "privcode.mountPath" $root }}
        {{- end }}
        {{- range $servingPaths }}
        - name: artifacts
          mountPath: {{ printf "%s/%s" (include "privcode.mountPath" $root | trimSuffix "/") . | quote }}
          subPath: {{ . | quote }}
          readOnly: true
        {{- end }}
        {{- if $executorToken }}
        - name: executor-token
          mountPath: {{ include "privcode.executorTokenDir" $root }}
          readOnly: true
        {{- end }}
        {{- if $store }}
        - name: privacy-store
          mountPath: {{ $root.Values.storage.privacyStore.mountPath | trimSuffix "/" }}
          {{- if $ledger }}
          readOnly: true
          {{- end }}
        {{- end }}
        {{- if $ledger }}
        - name: ledger-token
          mountPath: {{ include "privcode.ledgerTokenDir" $root }}
          readOnly: true
        {{- end }}
        {{- if $pacState }}
        - name: pac-state
          mountPath: {{ $root.Values.storage.pacState.mountPath | trimSuffix "/" }}
        {{- end }}
        {{- if $data }}
        - name: data
          mountPath: {{ $root.Values.storage.data.mountPath | trimSuffix "/" }}
          readOnly: true
        {{- end }}
        {{- if $models }}
        - name: models
          mountPath: {{ $root.Values.storage.models.mountPath | trimSuffix "/" }}
          readOnly: true
        {{- end }}
        {{- if and .serving $root.Values.apiKey.existingSecret }}
        - name: api-keys
          mountPath: {{ include "privcode.apiKeysDir" $root }}
          readOnly: true
        {{- end }}
        {{- if and (not $isHead) .group.shmSize }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
  volumes:
    {{- include "privcode.tmpVolume" $root | trim | nindent 4 }}
    - name: pipeline-config
      configMap:
        name: {{ include "privcode.configMapName" $root }}
    {{- if not .serving }}
    - name: artifacts
      {{- if $root.Values.storage.pvc.enabled }}
      persistentVolumeClaim:
        claimName: {{ include "privcode.pvcName" $root }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- else if $servingPaths }}
    {{- /* the release's directories only (subPath mounts above), never the whole volume */}}
    - name: artifacts
      persistentVolumeClaim:
        claimName: {{ include "privcode.pvcName" $root }}
        readOnly: true
    {{- end }}
    {{- if $executorToken }}
    - name: executor-token
      secret:
        secretName: {{ include "privcode.executorTokenSecret" $root | quote }}
        items:
          - key: token
            path: token
        defaultMode: {{ ternary 288 292 (hasKey (default (dict) $root.Values.podSecurityContext) "fsGroup") }}
    {{- end }}
    {{- if $store }}
    - name: privacy-store
      persistentVolumeClaim:
        claimName: {{ include "privcode.storePvcName" $root }}
        {{- if $ledger }}
        {{- /* the ledger Deployment is the store's one writer; these pods read its keys */}}
        readOnly: true
        {{- end }}
    {{- end }}
    {{- if $ledger }}
    {{- /* this role's token only: a serving pod cannot present the pipeline's */}}
    - name: ledger-token
      projected:
        defaultMode: {{ ternary 288 292 (hasKey (default (dict) $root.Values.podSecurityContext) "fsGroup") }}
        sources:
          - secret:
              name: {{ include "privcode.ledgerSecretName" $root | quote }}
              items:
                - key: {{ $role }}
                  path: {{ $role }}
    {{- end }}
    {{- if $pacState }}
    - name: pac-state
      persistentVolumeClaim:
        claimName: {{ include "privcode.pacStatePvcName" $root }}
    {{- end }}
    {{- if $data }}
    - name: data
      persistentVolumeClaim:
        claimName: {{ include "privcode.dataPvcName" $root }}
        readOnly: true
    {{- end }}
    {{- if $models }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ include "privcode.modelsPvcName" $root }}
        readOnly: true
    {{- end }}
    {{- if and .serving $root.Values.apiKey.existingSecret }}
    - name: api-keys
      secret:
        secretName: {{ $root.Values.apiKey.existingSecret | quote }}
        {{- /* 0440 with the pod's fsGroup (group-readable by the Ray user), else 0444 */}}
        defaultMode: {{ ternary 288 292 (hasKey (default (dict) $root.Values.podSecurityContext) "fsGroup") }}
    {{- end }}
    {{- if and (not $isHead) .group.shmSize }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .group.shmSize | quote }}
    {{- end }}
{{- end }}

{{/*
The RayCluster spec, defined once and used by the RayCluster (spec), the RayJob
(spec.rayClusterSpec) and the RayService (spec.rayClusterConfig).
Input: dict "root" . "serving" bool (the RayService's cluster: API key env, and the gpu worker
group when the premium model runs on vLLM) "operatorTemplate" bool (the operator's RayJob
template: no storage.data).
*/}}
{{- define "privcode.rayClusterSpec" -}}
{{- $root := .root }}
{{- $serving := .serving }}
{{- $operatorTemplate := .operatorTemplate }}
{{- include "privcode.validate" $root }}
rayVersion: {{ $root.Values.rayVersion | quote }}
enableInTreeAutoscaling: {{ $root.Values.autoscaling.enableInTreeAutoscaling }}
{{- if $root.Values.autoscaling.enableInTreeAutoscaling }}
{{- $ao := $root.Values.autoscaling.autoscalerOptions }}
autoscalerOptions:
  upscalingMode: {{ $ao.upscalingMode }}
  idleTimeoutSeconds: {{ int $ao.idleTimeoutSeconds }}
  {{- if $ao.version }}
  version: {{ $ao.version }}
  {{- end }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  {{- with $ao.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: HOME
      value: /tmp
    {{- with $ao.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with include "privcode.sandboxEnv" $root }}
    {{- . | trim | nindent 4 }}
    {{- end }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- if eq $root.Values.auth.mode "token" }}
authOptions:
  mode: token
  {{- with $root.Values.auth.secretName }}
  secretName: {{ . | quote }}
  {{- end }}
{{- end }}
headGroupSpec:
  serviceType: {{ $root.Values.head.serviceType }}
  rayStartParams:
    {{- range $k, $v := $root.Values.head.rayStartParams }}
    {{ $k }}: {{ toString $v | quote }}
    {{- else }} {}
    {{- end }}
  template:
    {{- include "privcode.rayPodTemplate" (dict "root" $root "kind" "head" "group" $root.Values.head "serving" $serving "operatorTemplate" $operatorTemplate) | trim | nindent 4 }}
{{- $groups := list }}
{{- /* the RayService's vLLM replicas need GPU nodes: its cluster has the gpu group anyway */}}
{{- $vllm := and $serving (include "privcode.premiumVllm" $root) }}
{{- range $name, $g := $root.Values.workerGroups }}
{{- if or $g.enabled (and $vllm (eq $name "gpu")) }}
{{- $groups = append $groups $name }}
{{- end }}
{{- end }}
{{- if $groups }}
workerGroupSpecs:
  {{- range $name := $groups }}
  {{- $g := index $root.Values.workerGroups $name }}
  {{- $params := deepCopy (default (dict) $g.rayStartParams) }}
  {{- if hasKey $g "gpusPerWorker" }}
  {{- $_ := set $params "num-gpus" (toString (int $g.gpusPerWorker)) }}
  {{- end }}
  - groupName: {{ $name }}
    replicas: {{ int $g.replicas }}
    minReplicas: {{ int $g.minReplicas }}
    maxReplicas: {{ int $g.maxReplicas }}
    rayStartParams:
      {{- range $k, $v := $params }}
      {{ $k }}: {{ toString $v | quote }}
      {{- else }} {}
      {{- end }}
    template:
      {{- include "privcode.rayPodTemplate" (dict "root" $root "kind" "worker" "group" $g "groupName" $name "serving" $serving "operatorTemplate" $operatorTemplate) | trim | nindent 6 }}
  {{- end }}
{{- end }}
{{- end }}
