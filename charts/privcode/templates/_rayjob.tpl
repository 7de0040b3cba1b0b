{{/*
The pipeline's RayJob (jobs/pipeline.py on its own Ray cluster), defined once: templates/rayjob.yaml
renders it with job.enabled, and templates/operator.yaml puts the same rendering into the
operator's template ConfigMap (key rayjob-template.yaml, also with job.enabled=false), from which
`privcode operator` makes each admitted PrivCodeRun's RayJob (privcode/operator/children.py).
The template differs from the chart's own RayJob in one thing only: it leaves out the chart's
data claim (storage.data), as each run gets the data claim it names (mounted by the operator at
<operator.dataRoot>/<claim>).
*/}}
{{- define "privcode.rayjob" -}}
{{- include "privcode.rayjobFor" (dict "root" . "operatorTemplate" false) }}
{{- end }}

{{/* The operator's template: privcode.rayjob without storage.data. */}}
{{- define "privcode.rayjobTemplate" -}}
{{- include "privcode.rayjobFor" (dict "root" . "operatorTemplate" true) }}
{{- end }}

{{/* Input: dict "root" . "operatorTemplate" bool. */}}
{{- define "privcode.rayjobFor" -}}
{{- $operatorTemplate := .operatorTemplate }}
{{- with .root -}}
apiVersion: ray.io/v1
kind: RayJob
metadata:
  name: {{ include "privcode.rayName" . }}
  labels:
    {{- include "privcode.labels" . | nindent 4 }}
    app.kubernetes.io/component: pipeline-job
spec:
  entrypoint: {{ include "privcode.entrypoint" . | quote }}
  {{- with .Values.job.runtimeEnv }}
  runtimeEnvYAML: |
    {{- toYaml . | nindent 4 }}
  {{- end }}
  shutdownAfterJobFinishes: {{ .Values.job.shutdownAfterJobFinishes }}
  {{- if .Values.job.shutdownAfterJobFinishes }}
  ttlSecondsAfterFinished: {{ int .Values.job.ttlSecondsAfterFinished }}
  {{- end }}
  backoffLimit: {{ int .Values.job.backoffLimit }}
  {{- if gt (int .Values.job.activeDeadlineSeconds) 0 }}
  activeDeadlineSeconds: {{ int .Values.job.activeDeadlineSeconds }}
  {{- end }}
  submissionMode: {{ .Values.job.submissionMode }}
  {{- if eq .Values.job.submissionMode "K8sJobMode" }}
  # The Kubernetes Job (named like the RayJob) that runs `ray job submit`; KubeRay fills in the
  # command. Its role label (submitter) lets it reach the job's head on the dashboard port
  # (8265: `ray job submit` and `ray job logs`) and nothing else (templates/networkpolicy.yaml).
  submitterPodTemplate:
    metadata:
      labels:
        {{- include "privcode.labels" . | nindent 8 }}
        app.kubernetes.io/component: job-submitter
        {{ include "privcode.roleKey" . }}: submitter
    spec:
      restartPolicy: Never
      serviceAccountName: {{ include "privcode.serviceAccountName" . }}
      automountServiceAccountToken: false
      {{- with .Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-job-submitter
          image: {{ include "privcode.image" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          {{- with .Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          env:
            - name: HOME
              value: /tmp
            - name: RAY_USAGE_STATS_ENABLED
              value: "0"
            {{- with include "privcode.sandboxEnv" . }}
            {{- . | trim | nindent 12 }}
            {{- end }}
          {{- with .Values.job.submitter.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
      volumes:
        {{- include "privcode.tmpVolume" . | trim | nindent 8 }}
  {{- end }}
  rayClusterSpec:
    {{- include "privcode.rayClusterSpec" (dict "root" . "serving" false "operatorTemplate" $operatorTemplate) | trim | nindent 4 }}
{{- end }}
{{- end }}
