{{/* Names and labels. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* 40 characters at most. Every object's name must fit in 63 characters with what
Kubernetes adds: a StatefulSet's pods carry a controller-revision-hash label of its name plus
11 characters (the scheduler's: 40 + 10 + 11), a LeaderWorkerSet's worker StatefulSets add
"-<group>" to its name (40 + 8 + 4 + 11), and the longest Service name adds
"-scheduler-headless" (19). */}}
{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name | trunc 63 | trimSuffix "-" }}
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

{{/* The scheduler replicas, for the workers: the headless Service's DNS name, which answers
with every replica's address (ready or not); a worker re-resolves it and registers with each,
so the replica count is in no worker's arguments. */}}
{{- define "baton.schedulerReplicas" -}}
dns:{{ include "baton.fullname" . }}-scheduler-headless.{{ .Release.Namespace }}.svc:{{ .Values.scheduler.port }}
{{- end -}}

{{/* The Redis of the release (no password); an external one's URL is in a Secret. */}}
{{- define "baton.redisUrl" -}}
{{- if and .Values.redis.enabled (not (include "baton.externalRedis" .)) -}}
redis://{{ include "baton.fullname" . }}-redis:6379/0
{{- end -}}
{{- end -}}

{{- define "baton.externalRedis" -}}
{{- if or .Values.redis.external.url .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "baton.redisSecret" -}}
{{- default (printf "%s-redis-url" (include "baton.fullname" .)) .Values.redis.external.existingSecret -}}
{{- end -}}

{{- define "baton.tokenSecret" -}}
{{- default (printf "%s-internal-token" (include "baton.fullname" .)) .Values.internalToken.existingSecret -}}
{{- end -}}

{{- define "baton.modelPath" -}}
{{- if .Values.model.subPath -}}/models/{{ .Values.model.subPath }}{{- else if eq .Values.model.source "tiny" -}}/models/tiny{{- else -}}/models{{- end -}}
{{- end -}}

{{/* The model volume, and the init container that fills it (image / url / tiny). Called
with (dict "root" $ "sizeLimit" "2Gi" "filesOnly" true): the gateway copies the tokenizer and
the config only (every file but the weight shards; a .gguf holds its tokenizer, so it stays). */}}
{{- define "baton.modelVolume" -}}
{{- $v := .root.Values.model -}}
- name: model
{{- if eq $v.source "pvc" }}
  persistentVolumeClaim: {claimName: {{ $v.pvc.claimName | quote }}, readOnly: true}
{{- else if eq $v.source "hostPath" }}
  hostPath: {path: {{ $v.hostPath.path | quote }}, type: Directory}
{{- else if .sizeLimit }}
  emptyDir: {sizeLimit: {{ .sizeLimit }}}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The ephemeral-storage request of a pod that copies the model into an emptyDir. */}}
{{- define "baton.modelStorage" -}}
{{- if and (has .root.Values.model.source (list "image" "url" "tiny")) .sizeLimit -}}
{{ .sizeLimit }}
{{- end -}}
{{- end -}}

{{- define "baton.weightPatterns" -}}
*.safetensors *.bin *.pt *.pth *.ckpt *.h5 *.msgpack *.onnx *.npz
{{- end -}}

{{- define "baton.modelInit" -}}
{{- $v := .root.Values.model -}}
{{- $sc := include "baton.containerSecurity" (dict "ipcLock" false) -}}
{{- $excludes := list -}}
{{- range (include "baton.weightPatterns" . | splitList " ") }}{{ $excludes = append $excludes (printf "--exclude='%s'" .) }}{{ end -}}
{{- $storage := include "baton.modelStorage" . -}}
{{- if eq $v.source "image" }}
- name: model-copy
  image: "{{ $v.image.repository }}:{{ $v.image.tag }}"
  {{- if .filesOnly }}
  command: ["sh", "-c", "tar -cf - -C \"$MODEL_DIR\" {{ join " " $excludes }} . | tar -xf - -C /models"]
  env: [{name: MODEL_DIR, value: {{ $v.image.path | quote }}}]
  {{- else }}
  command: ["cp", "-r", "{{ $v.image.path }}/.", "/models/"]
  {{- end }}
  volumeMounts: [{name: model, mountPath: /models}]
  securityContext: {{ $sc | nindent 4 }}
  {{- with $storage }}
  resources: {requests: {ephemeral-storage: {{ . }}}}
  {{- end }}
{{- else if eq $v.source "url" }}
- name: model-download
  image: {{ $v.url.image | quote }}
  command: ["sh", "-c", "curl -fsSL \"$MODEL_URL\" | tar -xz -C /models{{ if .filesOnly }} {{ join " " $excludes }}{{ end }}"]
  env: [{name: MODEL_URL, value: {{ $v.url.location | quote }}}]
  volumeMounts: [{name: model, mountPath: /models}]
  securityContext: {{ $sc | nindent 4 }}
  {{- with $storage }}
  resources: {requests: {ephemeral-storage: {{ . }}}}
  {{- end }}
{{- else if eq $v.source "tiny" }}
- name: model-tiny
  image: "{{ .root.Values.image.worker.repository }}:{{ .root.Values.image.worker.tag }}"
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

{{/* A pod template's annotations: (dict "root" $ "v" <values> "port" <metrics port, 0: none>
"extra" <more>): the component's podAnnotations, and Prometheus' scrape annotations when no
monitor of the operator scrapes it. */}}
{{- define "baton.podAnnotations" -}}
{{- $out := merge (dict) (.extra | default dict) (.v.podAnnotations | default dict) -}}
{{- if and .port (not (include "baton.serviceMonitors" .root)) -}}
{{- $_ := set $out "prometheus.io/scrape" "true" -}}
{{- $_ := set $out "prometheus.io/port" (toString .port) -}}
{{- $_ := set $out "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- with $out }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* "true" when ServiceMonitors are rendered. */}}
{{- define "baton.serviceMonitors" -}}
{{- $m := .Values.monitoring.serviceMonitor.enabled | toString -}}
{{- if or (eq $m "true") (and (eq $m "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end -}}


{{/* Placement of a component's pods: (dict "root" $ "v" <values> "component" <name>).
Without .v.affinity, .v.antiAffinity spreads the component's pods over nodes. */}}
{{- define "baton.placement" -}}
{{- $v := .v -}}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $v.affinity }}
affinity: {{- toYaml $v.affinity | nindent 2 }}
{{- else if ne $v.antiAffinity "none" }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "baton.selectorLabels" . | fromYaml)) }}
affinity:
  podAntiAffinity:
    {{- if eq $v.antiAffinity "hard" }}
    requiredDuringSchedulingIgnoredDuringExecution: {{- toYaml (list $term) | nindent 6 }}
    {{- else }}
    preferredDuringSchedulingIgnoredDuringExecution: {{- toYaml (list (dict "weight" 100 "podAffinityTerm" $term)) | nindent 6 }}
    {{- end }}
{{- end }}
{{- with $v.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.topologySpreadConstraints }}
topologySpreadConstraints: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A component's PodDisruptionBudget: (dict "root" $ "v" <values> "component" <name>). */}}
{{- define "baton.pdb" -}}
{{- if .v.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "baton.fullname" .root }}-{{ .component }}
  labels: {{- include "baton.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .v.pdb.maxUnavailable }}
  unhealthyPodEvictionPolicy: {{ .v.pdb.unhealthyPodEvictionPolicy }}
  selector:
    matchLabels: {{- include "baton.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}


{{/* A container's resources: (dict "v" <requests/limits> "storage" <ephemeral-storage
request, or "">). */}}
{{- define "baton.resources" -}}
{{- $r := deepCopy (.v | default dict) -}}
{{- if .storage -}}
{{- $req := $r.requests | default dict -}}
{{- $_ := set $req "ephemeral-storage" .storage -}}
{{- $_ := set $r "requests" $req -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* The scheduler's ConfigMap data (its pod template's checksum covers all of it: the
scheduler reads both files at start only). A pool's GPUs per replica count every pod of a
LeaderWorkerSet group. */}}
{{- define "baton.schedulerConfig" -}}
{{- $p := .Values.planner -}}
{{- $bounds := dict -}}
{{- range $name, $w := (include "baton.pools" . | fromYaml) -}}
{{- $pods := ternary (int $w.leaderWorkerSet.size) 1 $w.leaderWorkerSet.enabled -}}
{{- $_ := set $bounds $name (dict "min_replicas" (int $w.autoscaling.minReplicas) "max_replicas" (int $w.autoscaling.maxReplicas) "gpus_per_replica" (mul (int $w.gpus) $pods)) -}}
{{- end -}}
routing-policy.json: {{ .Values.scheduler.routingPolicy | toJson | quote }}
planner.json: {{ dict "interval_s" $p.intervalSeconds "prefill_backlog_target_s" $p.prefillBacklogTargetSeconds "decode_kv_usage_target" $p.decodeKvUsageTarget "decode_running_target" $p.decodeRunningTarget "tolerance" $p.tolerance "min_prefill_decode_ratio" $p.minPrefillDecodeRatio "max_prefill_decode_ratio" $p.maxPrefillDecodeRatio "gpu_budget" $p.gpuBudget "scale_up_pods" $p.scaleUp.pods "scale_up_period_s" $p.scaleUp.periodSeconds "scale_up_stabilization_s" $p.scaleUp.stabilizationWindowSeconds "scale_down_pods" $p.scaleDown.pods "scale_down_period_s" $p.scaleDown.periodSeconds "scale_down_stabilization_s" $p.scaleDown.stabilizationWindowSeconds "pools" $bounds | toJson | quote }}
{{- end -}}
