{{/* Names and labels. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "baton.labels" -}}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The worker pools that run: name → values ("both" when colocated). */}}
{{- define "baton.pools" -}}
{{- $pools := dict -}}
{{- if .Values.colocated.enabled -}}
{{- $_ := set $pools "both" .Values.colocated -}}
{{- else -}}
{{- if .Values.prefill.enabled }}{{ $_ := set $pools "prefill" .Values.prefill }}{{ end -}}
{{- if .Values.decode.enabled }}{{ $_ := set $pools "decode" .Values.decode }}{{ end -}}
{{- end -}}
{{- toYaml $pools -}}
{{- end -}}

{{- define "baton.schedulerAddress" -}}
{{ include "baton.fullname" . }}-scheduler:{{ .Values.scheduler.port }}
{{- end -}}

{{/* Every scheduler replica by its stable name: a worker registers with each. */}}
{{- define "baton.schedulerReplicas" -}}
{{- $full := include "baton.fullname" . -}}
{{- $out := list -}}
{{- range $i := until (int .Values.scheduler.replicas) -}}
{{- $out = append $out (printf "%s-scheduler-%d.%s-scheduler-headless.%s.svc:%d" $full $i $full $.Release.Namespace (int $.Values.scheduler.port)) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- define "baton.redisUrl" -}}
{{- if .Values.redis.external.url -}}
{{ .Values.redis.external.url }}
{{- else if .Values.redis.enabled -}}
redis://{{ include "baton.fullname" . }}-redis:6379/0
{{- end -}}
{{- end -}}

{{- define "baton.tokenSecret" -}}
{{- default (printf "%s-internal-token" (include "baton.fullname" .)) .Values.internalToken.existingSecret -}}
{{- end -}}

{{- define "baton.modelPath" -}}
{{- if .Values.model.subPath -}}/models/{{ .Values.model.subPath }}{{- else if eq .Values.model.source "tiny" -}}/models/tiny{{- else -}}/models{{- end -}}
{{- end -}}

{{/* The model volume, and the init container that fills it (image / url / tiny). */}}
{{- define "baton.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim: {claimName: {{ .Values.model.pvc.claimName | quote }}, readOnly: true}
{{- else if eq .Values.model.source "hostPath" }}
  hostPath: {path: {{ .Values.model.hostPath.path | quote }}, type: Directory}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "baton.modelInit" -}}
{{- $sc := include "baton.containerSecurity" (dict "ipcLock" false) -}}
{{- if eq .Values.model.source "image" }}
- name: model-copy
  image: "{{ .Values.model.image.repository }}:{{ .Values.model.image.tag }}"
  command: ["cp", "-r", "{{ .Values.model.image.path }}/.", "/models/"]
  volumeMounts: [{name: model, mountPath: /models}]
  securityContext: {{ $sc | nindent 4 }}
{{- else if eq .Values.model.source "url" }}
- name: model-download
  image: {{ .Values.model.url.image | quote }}
  command: ["sh", "-c", "curl -fsSL \"$MODEL_URL\" | tar -xz -C /models"]
  env: [{name: MODEL_URL, value: {{ .Values.model.url.location | quote }}}]
  volumeMounts: [{name: model, mountPath: /models}]
  securityContext: {{ $sc | nindent 4 }}
{{- else if eq .Values.model.source "tiny" }}
- name: model-tiny
  image: "{{ .Values.image.worker.repository }}:{{ .Values.image.worker.tag }}"
  args: ["make-tiny-model", "/models/tiny", "--arch", "qwen3"]
  volumeMounts: [{name: model, mountPath: /models}]
  securityContext: {{ $sc | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "baton.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- if .ipcLock }}
  add: [IPC_LOCK]
{{- end }}
{{- end -}}

{{/* The downward API: each pod's IP (it binds there, nowhere else) and its name. */}}
{{- define "baton.podEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: BATON_INTERNAL_TOKEN_FILE
  value: /etc/baton/token/token
- name: HOME
  value: /tmp
{{- end -}}

{{- define "baton.tokenVolume" -}}
- name: internal-token
  secret: {secretName: {{ include "baton.tokenSecret" . }}, defaultMode: 0400}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "baton.tokenMount" -}}
- {name: internal-token, mountPath: /etc/baton/token, readOnly: true}
- {name: tmp, mountPath: /tmp}
{{- end -}}

{{- define "baton.scrape" -}}
{{- if not (include "baton.serviceMonitors" .root) }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* "true" when ServiceMonitors are rendered. */}}
{{- define "baton.serviceMonitors" -}}
{{- $m := .Values.monitoring.serviceMonitor.enabled | toString -}}
{{- if or (eq $m "true") (and (eq $m "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end -}}
