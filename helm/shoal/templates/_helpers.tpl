{{/*
Names, labels, the image, the `shoal serve` command line, the head's script and the pieces of
a worker group. Everything the templates share lives here.
*/}}

{{- define "shoal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* KubeRay appends -head-xxxxx / -<group>-worker-xxxxx to it: keep room for those. */}}
{{- define "shoal.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "shoal.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* KubeRay labels every pod of the cluster; the head alone carries node-type head. */}}
{{- define "shoal.headSelector" -}}
ray.io/cluster: {{ include "shoal.fullname" . }}
ray.io/node-type: head
{{- end }}

{{- define "shoal.image" -}}
{{- $variant := ternary "-vllm" "" (eq .Values.modelSpec.engine "vllm") }}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s%s" .Chart.AppVersion $variant) .Values.image.tag) }}
{{- end }}

{{- define "shoal.apiKeySecretName" -}}
{{- if .Values.server.apiKey.existingSecret }}
{{- .Values.server.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "shoal.fullname" .) }}
{{- end }}
{{- end }}

{{- define "shoal.hasApiKey" -}}
{{- if or .Values.server.apiKey.value .Values.server.apiKey.existingSecret }}true{{ end }}
{{- end }}

{{/*
Tenants' keys: the Secret's --api-key-file, mounted on the head at tenantsDir. Refused beside
a single apiKey (shoal serve takes one or the other).
*/}}
{{- define "shoal.hasTenants" -}}
{{- if .Values.server.tenants.existingSecret }}
{{- if include "shoal.hasApiKey" . }}
{{- fail "server.tenants and server.apiKey: give one (the tenants' file may hold a `default` tenant)" }}
{{- end }}
{{- print "true" }}
{{- end }}
{{- end }}

{{- define "shoal.tenantsDir" -}}/etc/shoal/tenants{{- end }}

{{- define "shoal.rayMetricsPort" -}}
{{- index .Values.head.rayStartParams "metrics-export-port" | default "8080" }}
{{- end }}

{{/* KubeRay passes --dashboard-agent-listen-port=52365 unless rayStartParams names another. */}}
{{- define "shoal.agentPort" -}}
{{- index .Values.head.rayStartParams "dashboard-agent-listen-port" | default "52365" }}
{{- end }}

{{- define "shoal.gcsPort" -}}
{{- index .Values.head.rayStartParams "port" | default "6379" }}
{{- end }}

{{/* The model volume source, from exactly one of existingClaim, hostPath, spec. */}}
{{- define "shoal.modelVolumeSource" -}}
{{- $v := .Values.modelSpec.volume }}
{{- $set := 0 }}
{{- if $v.existingClaim }}{{ $set = add1 $set }}{{ end }}
{{- if $v.hostPath }}{{ $set = add1 $set }}{{ end }}
{{- if $v.spec }}{{ $set = add1 $set }}{{ end }}
{{- if gt $set 1 }}
{{- fail "modelSpec.volume: set only one of existingClaim, hostPath and spec" }}
{{- end }}
{{- if $v.existingClaim }}
persistentVolumeClaim:
  claimName: {{ $v.existingClaim }}
  {{- /* The download's init container writes to it; the engines' mount stays read-only. */}}
  readOnly: {{ and $v.readOnly (not .Values.modelSpec.download.enabled) }}
{{- else if $v.hostPath }}
hostPath:
  path: {{ $v.hostPath }}
  type: Directory
{{- else if $v.spec }}
{{- toYaml $v.spec }}
{{- end }}
{{- end }}

{{- define "shoal.modelPath" -}}
{{- $v := .Values.modelSpec.volume }}
{{- if or $v.existingClaim $v.hostPath $v.spec }}
{{- printf "%s/%s" (trimSuffix "/" $v.mountPath) (trimPrefix "/" .Values.modelSpec.path) }}
{{- else }}
{{- .Values.modelSpec.path }}
{{- end }}
{{- end }}

{{/*
GPUs each rank reserves: gpusPerRank, or by default one per tensor-parallel worker. A value
that is neither (nor 0, for CPU workers) is refused, as `shoal serve` refuses it.
*/}}
{{- define "shoal.gpusPerRank" -}}
{{- $m := .Values.modelSpec }}
{{- $tp := int ($m.tensorParallelSize | default 1) }}
{{- if kindIs "invalid" $m.gpusPerRank }}
{{- $tp }}
{{- else }}
{{- if and (gt $tp 1) (gt (float64 $m.gpusPerRank) 0.0) (ne (float64 $m.gpusPerRank) (float64 $tp)) }}
{{- fail (printf "modelSpec.gpusPerRank %v conflicts with tensorParallelSize %d: each of a rank's workers runs on one GPU (leave gpusPerRank null to follow it)" $m.gpusPerRank $tp) }}
{{- end }}
{{- toString $m.gpusPerRank }}
{{- end }}
{{- end }}

{{/*
The `shoal serve` arguments, as a JSON list: each model-spec value maps onto the flag of the
same meaning that `shoal serve --help` lists.
*/}}
{{- define "shoal.serveArgs" -}}
{{- $m := .Values.modelSpec }}
{{- $args := list "--model" (include "shoal.modelPath" .) }}
{{- if $m.name }}
{{- $args = concat $args (list "--served-model-name" $m.name) }}
{{- end }}
{{- $args = concat $args (list "--namespace" .Values.server.namespace) }}
{{- if include "shoal.hasTenants" . }}
{{- $file := printf "%s/%s" (include "shoal.tenantsDir" .) .Values.server.tenants.secretKey }}
{{- $args = concat $args (list "--api-key-file" $file) }}
{{- end }}
{{- $args = concat $args (list "--host" "0.0.0.0" "--port" (toString .Values.server.port)) }}
{{- $args = concat $args (list "--data-parallel-size" (toString (int $m.dataParallelSize))) }}
{{- if gt (int ($m.tensorParallelSize | default 1)) 1 }}
{{- $args = concat $args (list "--tensor-parallel-size" (toString (int $m.tensorParallelSize))) }}
{{- end }}
{{- $args = concat $args (list "--num-gpus-per-rank" (include "shoal.gpusPerRank" .)) }}
{{- if $m.enableExpertParallel }}
{{- $args = append $args "--enable-expert-parallel" }}
{{- end }}
{{- if $m.maxModelLen }}
{{- $args = concat $args (list "--max-model-len" (toString (int $m.maxModelLen))) }}
{{- end }}
{{- $args = concat $args (list "--dtype" $m.dtype) }}
{{- if eq $m.engine "vllm" }}
{{- $args = concat $args (list "--engine" "vllm") }}
{{- end }}
{{- $maxRanks := include "shoal.autoscaledMaxRanks" . }}
{{- with .Values.autoscaling }}
{{- if .enabled }}
{{- if .maxDataParallelSize }}
{{- $maxRanks = toString (int .maxDataParallelSize) }}
{{- else if not $maxRanks }}
{{- fail "autoscaling.enabled needs autoscaling.maxDataParallelSize (or head.enableInTreeAutoscaling, which takes what the worker groups hold at maxReplicas)" }}
{{- end }}
{{- $args = concat $args (list "--autoscale" "--min-data-parallel-size" (toString (int .minDataParallelSize))) }}
{{- if .config }}
{{- $args = concat $args (list "--autoscaling-config" (toJson .config)) }}
{{- end }}
{{- end }}
{{- end }}
{{- with $maxRanks }}
{{- $args = concat $args (list "--max-data-parallel-size" .) }}
{{- end }}
{{- $args = concat $args $m.extraArgs }}
{{- toJson $args }}
{{- end }}

{{/*
With the autoscaler on, the most ranks the worker groups hold at maxReplicas: a resize
(`POST /scale_elastic_ep`) up to it may wait for the pods the autoscaler adds; past it, it is
refused at once. Empty without the autoscaler (then a resize fits the live nodes).
*/}}
{{- define "shoal.autoscaledMaxRanks" -}}
{{- $perRank := float64 (include "shoal.gpusPerRank" .) }}
{{- if and .Values.head.enableInTreeAutoscaling (gt $perRank 0.0) }}
{{- $fit := 0 }}
{{- $groups := list }}
{{- if not .Values.worker.disabled }}
{{- $groups = append $groups .Values.worker }}
{{- end }}
{{- range $name, $group := .Values.additionalWorkerGroups }}
{{- if not $group.disabled }}
{{- $groups = append $groups $group }}
{{- end }}
{{- end }}
{{- range $groups }}
{{- $fit = add $fit (mul (int .maxReplicas) (int (floor (divf (float64 .gpus) $perRank)))) }}
{{- end }}
{{- $fit }}
{{- end }}
{{- end }}

{{/* One word for bash, single-quoted unless it is plainly safe. */}}
{{- define "shoal.shellWord" -}}
{{- if regexMatch "^[A-Za-z0-9_./=:,+@%-]+$" . }}
{{- . }}
{{- else }}
{{- printf "'%s'" (replace "'" "'\\''" .) }}
{{- end }}
{{- end }}

{{- define "shoal.serveCommand" -}}
{{- $words := list "shoal" "serve" }}
{{- range (include "shoal.serveArgs" . | fromJsonArray) }}
{{- $words = append $words (include "shoal.shellWord" (toString .)) }}
{{- end }}
{{- join " " $words }}
{{- end }}

{{/*
The head container's script. Ray's head starts exactly as KubeRay generates it from
rayStartParams (KUBERAY_GEN_RAY_START_CMD, with --block), `shoal serve` starts once the GCS
and the local raylet answer (its `--address auto` is KubeRay's RAY_ADDRESS, the local head),
and the container ends when either ends, so that Kubernetes restarts both together.
SIGTERM stops shoal serve first (it tears the engines down), then Ray.
*/}}
{{- define "shoal.headScript" -}}
ulimit -n 65536
/bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &
ray_pid=$!
serve_pid=""
stop() {
  if [ -n "$serve_pid" ]; then kill -TERM "$serve_pid" 2>/dev/null; wait "$serve_pid"; fi
  kill -TERM "$ray_pid" 2>/dev/null
  wait "$ray_pid"
  exit 0
}
trap stop TERM INT
# Up: the GCS answers and the local raylet is healthy (what KubeRay's own head probe checks).
# The port is tried first: a health check of a GCS that is not there waits ~45 s, and a
# `ray start` that failed must end the container at once.
ray_is_up() {
  (exec 3<>"/dev/tcp/127.0.0.1/{{ include "shoal.gcsPort" . }}") 2>/dev/null &&
    ray health-check --address "127.0.0.1:{{ include "shoal.gcsPort" . }}" >/dev/null 2>&1 &&
    python -c 'import urllib.request as r; r.urlopen("http://127.0.0.1:{{ include "shoal.agentPort" . }}/api/local_raylet_healthz", timeout=2)' >/dev/null 2>&1
}
while :; do
  kill -0 "$ray_pid" 2>/dev/null || { echo "ray start exited" >&2; exit 1; }
  ray_is_up && break
  sleep 2
done
{{ include "shoal.serveCommand" . }} &
serve_pid=$!
wait -n "$ray_pid" "$serve_pid"
status=$?
echo "ray or shoal serve exited (status $status); ending the head" >&2
kill -TERM "$serve_pid" "$ray_pid" 2>/dev/null
wait
exit 1
{{- end }}

{{/*
The model download's init container: huggingface_hub's snapshot_download of repoId at
revision into the model's path in the volume. Its inputs come as environment variables, so no
value is ever parsed by a shell.
*/}}
{{- define "shoal.downloadScript" -}}
import json, os, sys
from huggingface_hub import snapshot_download
target = os.environ["SHOAL_MODEL_DIR"]
print(f"downloading {os.environ['SHOAL_MODEL_REPO']}@{os.environ['SHOAL_MODEL_REVISION']} into {target}", flush=True)
snapshot_download(
    repo_id=os.environ["SHOAL_MODEL_REPO"],
    revision=os.environ["SHOAL_MODEL_REVISION"],
    local_dir=target,
    allow_patterns=json.loads(os.environ["SHOAL_MODEL_ALLOW_PATTERNS"]) or None,
)
print(f"model ready in {target}", flush=True)
{{- end }}

{{- define "shoal.downloadContainer" -}}
{{- $root := . }}
{{- $d := .Values.modelSpec.download }}
{{- if not $d.repoId }}
{{- fail "modelSpec.download.enabled: give modelSpec.download.repoId (e.g. Qwen/Qwen2.5-7B-Instruct)" }}
{{- end }}
{{- if not (include "shoal.modelVolumeSource" .) }}
{{- fail "modelSpec.download.enabled: the model needs a volume to be downloaded into (modelSpec.volume)" }}
{{- end }}
- name: download-model
  image: {{ include "shoal.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - {{ include "shoal.downloadScript" . | quote }}
  env:
    - name: SHOAL_MODEL_REPO
      value: {{ $d.repoId | quote }}
    - name: SHOAL_MODEL_REVISION
      value: {{ $d.revision | toString | quote }}
    - name: SHOAL_MODEL_DIR
      value: {{ include "shoal.modelPath" . | quote }}
    - name: SHOAL_MODEL_ALLOW_PATTERNS
      value: {{ toJson (default list $d.allowPatterns) | quote }}
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    - name: HF_HOME
      value: /tmp/hf-home
    {{- with $d.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- with $d.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $d.tokenSecret.key }}
    {{- end }}
  {{- with $d.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.modelSpec.volume.mountPath }}
{{- end }}

{{- define "shoal.workerScript" -}}
ulimit -n 65536; exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"
{{- end }}

{{/* Shared pod-spec fields of a group: dict "root" $ "group" <values of the group>. */}}
{{- define "shoal.podPlacement" -}}
{{- $g := .group }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $g.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $g.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $g.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A container's resources with nvidia.com/gpu added to limits and requests: dict "resources" "gpus". */}}
{{- define "shoal.gpuResources" -}}
{{- $limits := deepCopy (default dict .resources.limits) }}
{{- $requests := deepCopy (default dict .resources.requests) }}
{{- if gt (int .gpus) 0 }}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $requests "nvidia.com/gpu" (int .gpus) }}
{{- end }}
{{- with $limits }}
limits:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $requests }}
requests:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* One entry of spec.workerGroupSpecs: dict "root" $ "name" <groupName> "group" <values>. */}}
{{- define "shoal.workerGroup" -}}
{{- $root := .root }}
{{- $g := .group }}
{{- $name := .name }}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) }}
{{- fail (printf "worker group %s: replicas (%d) must lie between minReplicas (%d) and maxReplicas (%d)" $name (int $g.replicas) (int $g.minReplicas) (int $g.maxReplicas)) }}
{{- end }}
{{- if hasKey (default dict $g.rayStartParams) "num-gpus" }}
{{- fail (printf "worker group %s: set its gpus, not rayStartParams.num-gpus (the chart keeps the two equal)" $name) }}
{{- end }}
- groupName: {{ $name }}
  replicas: {{ int $g.replicas }}
  minReplicas: {{ int $g.minReplicas }}
  maxReplicas: {{ int $g.maxReplicas }}
  rayStartParams:
    {{- range $k, $v := $g.rayStartParams }}
    {{ $k }}: {{ toString $v | quote }}
    {{- end }}
    num-gpus: {{ toString (int $g.gpus) | quote }}
  template:
    metadata:
      labels:
        {{- include "shoal.labels" $root | nindent 8 }}
        {{- with $g.labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $g.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "shoal.podPlacement" (dict "root" $root "group" $g) | nindent 6 }}
      {{- with $root.Values.drain }}
      {{- if .enabled }}
      # The drain's deadline, and time for its hand-over, before the pod is killed.
      terminationGracePeriodSeconds: {{ add (int .deadlineSeconds) 30 }}
      {{- end }}
      {{- end }}
      {{- if $root.Values.modelSpec.download.enabled }}
      initContainers:
        {{- include "shoal.downloadContainer" $root | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "shoal.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          # The cluster's ray.io/overwrite-container-cmd covers every pod: workers run exactly
          # the `ray start` KubeRay generates for them, as KubeRay itself would.
          command: ["/bin/bash", "-c", "--"]
          args:
            - {{ include "shoal.workerScript" $root | quote }}
          {{- if or $g.containerEnv $root.Values.drain.enabled }}
          env:
            {{- if $root.Values.drain.enabled }}
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- end }}
            {{- with $g.containerEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- end }}
          {{- if $root.Values.drain.enabled }}
          # Deleted (a rollout, a node drain, an eviction): this pod's ranks take no new
          # requests and finish or hand over what they hold before Ray goes.
          lifecycle:
            preStop:
              exec:
                command:
                  - /bin/bash
                  - -c
                  - {{ printf "shoal drain --namespace %s --node-ip \"$POD_IP\" --no-restart --deadline-s %d" (include "shoal.shellWord" $root.Values.server.namespace) (int $root.Values.drain.deadlineSeconds) | quote }}
          {{- end }}
          {{- with $g.envFrom }}
          envFrom:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          resources:
            {{- include "shoal.gpuResources" (dict "resources" (default dict $g.resources) "gpus" $g.gpus) | nindent 12 }}
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            {{- if include "shoal.modelVolumeSource" $root }}
            - name: model
              mountPath: {{ $root.Values.modelSpec.volume.mountPath }}
              readOnly: {{ $root.Values.modelSpec.volume.readOnly }}
            {{- end }}
            {{- with $g.volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ default "16Gi" $g.shmSize }}
        {{- with include "shoal.modelVolumeSource" $root }}
        - name: model
          {{- . | nindent 10 }}
        {{- end }}
        {{- with $g.volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}
