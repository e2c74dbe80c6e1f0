{{/* A worker pool's pod template: (dict "root" $ "v" <pool values> "component" <pool>
"part" <part>), part one of
  worker  a Deployment's pod: one `baton worker`
  leader  a LeaderWorkerSet group's leader: the Ray head, then `baton worker` as Ray's driver
  ray     a LeaderWorkerSet group's other pods: a Ray worker each, joined to the leader */}}
{{- define "baton.workerPod" -}}
{{- $ := .root -}}
{{- $w := .v -}}
{{- $pool := .component -}}
{{- $serves := ne .part "ray" -}}
{{- $lws := $w.leaderWorkerSet -}}
{{- $grace := int $w.terminationGracePeriodSeconds | default (add (int $w.preStopSeconds) (int $w.drainTimeoutSeconds) 30) -}}
{{- $model := dict "root" $ "sizeLimit" $.Values.model.cacheSizeLimit -}}
{{- $limits := merge (dict) $w.extraResources ($w.resources.limits | default dict) -}}
{{- if gt (int $w.gpus) 0 }}{{ $_ := set $limits $w.gpuResource (int $w.gpus) }}{{ end -}}
{{- $requests := deepCopy ($w.resources.requests | default dict) -}}
{{- with include "baton.modelStorage" $model }}{{ $_ := set $requests "ephemeral-storage" . }}{{ end -}}
{{- $image := $.Values.image.worker -}}
metadata:
  labels:
    {{- include "baton.labels" . | nindent 4 }}
    {{- if $serves }}
    baton.dev/worker: "true"
    {{- else }}
    baton.dev/ray-worker: "true"
    {{- end }}
    {{- with $w.podLabels }}{{ toYaml . | nindent 4 }}{{ end }}
  {{- with include "baton.podAnnotations" (dict "root" $ "v" $w "port" (ternary $w.metricsPort 0 $serves)) }}
  annotations: {{- . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "baton.fullname" $ }}-worker
  automountServiceAccountToken: false
  securityContext: {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ ternary $grace 30 $serves }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "baton.placement" . }}{{ . | trim | nindent 2 }}{{ end }}
  {{- with (include "baton.modelInit" $model) }}
  initContainers: {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "worker" "ray-worker" $serves }}
      image: "{{ $w.image.repository | default $image.repository }}:{{ $w.image.tag | default $image.tag }}"
      imagePullPolicy: {{ $w.image.pullPolicy | default $image.pullPolicy }}
      {{- if eq .part "leader" }}
      # the Ray head first (the group's other pods join it), then the worker as Ray's driver
      command:
        - sh
        - -c
        - >-
          ray start --head --port="$RAY_PORT" --node-ip-address="$POD_IP"
          --num-gpus={{ $w.gpus }} --include-dashboard=false
          && exec baton "$@"
        - baton
      {{- else if eq .part "ray" }}
      command:
        - sh
        - -c
        - >-
          exec ray start --address="$LWS_LEADER_ADDRESS:$RAY_PORT" --node-ip-address="$POD_IP"
          --num-gpus={{ $w.gpus }} --block
      {{- end }}
      {{- if $serves }}
      args:
        - worker
        - --model={{ include "baton.modelPath" $ }}
        - --served-model-name={{ $.Values.model.name }}
        - --block-size={{ $.Values.model.kvBlockSize }}
        - --role={{ $pool }}
        - --host=$(POD_IP)
        - --advertise-host=$(POD_IP)
        - --port={{ $w.port }}
        - --worker-id=$(POD_NAME)
        - --scheduler={{ include "baton.schedulerReplicas" $ }}
        - --metrics-port={{ $w.metricsPort }}
        - --drain-timeout={{ $w.drainTimeoutSeconds }}
        - --unregistered-exit-seconds={{ $w.unregisteredExitSeconds }}
        {{- if ne $pool "both" }}
        - --kv-transfer
        {{- end }}
        {{- if $lws.enabled }}
        - --tensor-parallel-size={{ mul (int $lws.size) (max 1 (int $w.gpus)) }}
        - --distributed-executor-backend=ray
        {{- end }}
        {{- range (concat $w.engineArgs $w.extraArgs) }}
        - {{ . | quote }}
        {{- end }}
      {{- end }}
      env:
        {{- include "baton.podEnv" $ | nindent 8 }}
        {{- if $lws.enabled }}
        - {name: RAY_PORT, value: {{ $lws.rayPort | quote }}}
        - {name: RAY_USAGE_STATS_ENABLED, value: "0"}
        {{- if eq .part "leader" }}
        - {name: RAY_ADDRESS, value: "$(POD_IP):{{ $lws.rayPort }}"}
        {{- end }}
        {{- end }}
        {{- if eq (int $w.gpus) 0 }}
        # the image exposes every GPU to the NVIDIA runtime (as NVIDIA's images do): a CPU
        # worker on a GPU node sees none
        - {name: NVIDIA_VISIBLE_DEVICES, value: void}
        {{- end }}
        {{- with $w.extraEnv }}{{ toYaml . | nindent 8 }}{{ end }}
      {{- with $w.envFrom }}
      envFrom: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $serves }}
      ports:
        - {name: grpc, containerPort: {{ $w.port }}, protocol: TCP}
        - {name: metrics, containerPort: {{ $w.metricsPort }}, protocol: TCP}
      # Started once the model is loaded (the probe port opens then), whatever the
      # schedulers do: a scheduler outage never restarts a loading worker
      startupProbe:
        httpGet: {path: /health, port: metrics}
        periodSeconds: {{ $w.startupProbe.periodSeconds }}
        failureThreshold: {{ $w.startupProbe.failureThreshold }}
      # Ready: serving, not draining, registered with a scheduler replica
      readinessProbe:
        httpGet: {path: /ready, port: metrics}
        periodSeconds: 5
        failureThreshold: 3
      # the event loop only: a long prefill runs in the engine core's process
      livenessProbe:
        httpGet: {path: /health, port: metrics}
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: 6
      lifecycle:
        preStop:  # the pod leaves endpoints and the scheduler cordons it; then SIGTERM
          sleep: {seconds: {{ $w.preStopSeconds }}}
      {{- end }}
      resources:
        {{- with $requests }}
        requests: {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $limits }}
        limits: {{- toYaml . | nindent 10 }}
        {{- end }}
      securityContext: {{- include "baton.containerSecurity" (dict "ipcLock" $w.ipcLock) | nindent 8 }}
      volumeMounts:
        {{- include "baton.tokenMount" $ | nindent 8 }}
        - {name: model, mountPath: /models, readOnly: true}
        - {name: shm, mountPath: /dev/shm}
        {{- with $w.extraVolumeMounts }}{{ toYaml . | nindent 8 }}{{ end }}
  volumes:
    {{- include "baton.tokenVolume" $ | nindent 4 }}
    {{- include "baton.modelVolume" $model | nindent 4 }}
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $w.shmSizeLimit }}}
    {{- with $w.extraVolumes }}{{ toYaml . | nindent 4 }}{{ end }}
{{- end -}}
