{{/* One worker role: headless Service + StatefulSet (+ PDB). (dict "root" $ "component" "prefill"|"decode"|"both") */}}
{{- define "tandem.worker" -}}
{{- $root := .root }}
{{- $spec := index $root.Values .component }}
{{- $component := .component }}
{{- $name := include "tandem.componentName" . }}
{{- $model := $root.Values.model }}
{{- $kv := $root.Values.kvTransfer }}
{{- $resources := deepCopy $spec.resources }}
{{- if eq $spec.device "cuda" }}
{{- $gpus := max (int $spec.gpus) (int $spec.tensorParallelSize) }}
{{- /* merge writes into its first argument: a fresh dict each time */}}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.limits)) }}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.requests)) }}
{{- end }}
{{- with $kv.rdmaResources }}
{{- $_ := set $resources "limits" (merge (deepCopy .) (default dict $resources.limits)) }}
{{- $_ := set $resources "requests" (merge (deepCopy .) (default dict $resources.requests)) }}
{{- end }}
{{- $securityContext := deepCopy $root.Values.securityContext }}
{{- if $kv.ipcLock }}
{{- $capabilities := default dict $securityContext.capabilities }}
{{- $_ := set $capabilities "add" (append (default list $capabilities.add) "IPC_LOCK" | uniq) }}
{{- $_ := set $securityContext "capabilities" $capabilities }}
{{- end }}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  clusterIP: None
  # The router polls each worker's health itself, so its pods resolve before they are ready.
  publishNotReadyAddresses: true
  ports:
    - name: grpc
      port: {{ int $spec.port }}
      targetPort: grpc
      appProtocol: grpc
    {{- with include "tandem.metricsServicePort" (dict "root" $root "port" $spec.metricsPort) }}{{ . | trim | nindent 4 }}{{- end }}
  selector:
    {{- include "tandem.selectorLabels" . | nindent 4 }}
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  serviceName: {{ $name }}
  replicas: {{ int $spec.replicas }}
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.labels" . | nindent 8 }}
      {{- with include "tandem.metricsAnnotations" (dict "root" $root "port" $spec.metricsPort) }}{{ . | trim | nindent 6 }}{{- end }}
    spec:
      {{- include "tandem.podCommon" (dict "root" $root "spec" $spec "component" .component "preStopSeconds" 0) | nindent 6 }}
      {{- if $kv.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [tandem]
          args:
            - serve
            - {{ .component }}
            - --host=0.0.0.0
            - --port={{ int $spec.port }}
            - --model={{ include "tandem.modelPath" $root }}
            - --dtype={{ $root.Values.engine.dtype }}
            - --block-size={{ int $root.Values.engine.blockSize }}
            {{- if $root.Values.engine.deterministic }}
            - --deterministic
            {{- end }}
            {{- with $root.Values.engine.modelImpl }}{{ if ne . "auto" }}
            - --model-impl={{ . }}
            {{- end }}{{ end }}
            {{- if gt (int $spec.numBlocks) 0 }}
            - --num-blocks={{ int $spec.numBlocks }}
            {{- else }}
            - --kv-cache-gb={{ $spec.kvCacheGb }}
            {{- end }}
            - --max-num-seqs={{ int $spec.maxNumSeqs }}
            - --max-num-batched-tokens={{ int $spec.maxNumBatchedTokens }}
            - --device={{ $spec.device }}
            {{- if gt (int $spec.tensorParallelSize) 1 }}
            - --tensor-parallel-size={{ int $spec.tensorParallelSize }}
            - --max-loras=0
            {{- end }}
            - --kv-lease-seconds={{ $spec.kvLeaseSeconds }}
            {{- with $spec.speculativeConfig }}
            - --speculative-config={{ toJson . }}
            {{- end }}
            {{- if $spec.engineProcess }}
            - --engine-process
            {{- end }}
            {{- if $spec.hostKvCacheGb }}
            - --host-kv-cache-gb={{ $spec.hostKvCacheGb }}
            {{- end }}
            {{- if and $root.Values.router.prefixPulls (ne $component "decode") }}
            - --kv-prefix-pulls
            {{- end }}
            {{- if hasKey $spec "kvRoomWaitSeconds" }}
            - --kv-room-wait-seconds={{ $spec.kvRoomWaitSeconds }}
            {{- end }}
            {{- if and (hasKey $spec "kvEarlyReserve") (not $spec.kvEarlyReserve) }}
            - --no-kv-early-reserve
            {{- end }}
            {{- if and $spec.kvLoadFailurePolicy (ne $spec.kvLoadFailurePolicy "recompute") }}
            - --kv-load-failure-policy={{ $spec.kvLoadFailurePolicy }}
            {{- end }}
            - --drain-seconds={{ int $root.Values.drain.seconds }}
            {{- include "tandem.metricsFlag" (dict "root" $root "port" $spec.metricsPort) | nindent 12 }}
            {{- with include "tandem.tlsArgs" (dict "root" $root "router" false) }}{{ . | trim | nindent 12 }}{{- end }}
            {{- range $spec.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: HOME
              value: /tmp
            - name: TANDEM_LOG_FORMAT
              value: {{ $root.Values.logFormat | quote }}
            {{- with $root.Values.tracing.otlpEndpoint }}
            - name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
              value: {{ . | quote }}
            {{- end }}
            {{- with include "tandem.tokenEnv" $root }}{{ . | trim | nindent 12 }}{{- end }}
            {{- with $spec.cudaIpcGetZcopy }}
            - name: UCX_CUDA_IPC_ENABLE_GET_ZCOPY
              value: {{ . | quote }}
            {{- end }}
            {{- with $kv.ucxTransports }}
            - name: UCX_TLS
              value: {{ . | quote }}
            {{- end }}
            {{- with $kv.ucxNetDevices }}
            - name: UCX_NET_DEVICES
              value: {{ . | quote }}
            {{- end }}
            {{- with $spec.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- include "tandem.ports" (dict "root" $root "port" $spec.port) | nindent 12 }}
            {{- with include "tandem.metricsContainerPort" (dict "root" $root "port" $spec.metricsPort) }}{{ . | trim | nindent 12 }}{{- end }}
          {{- include "tandem.probes" (dict "root" $root "port" $spec.port) | nindent 10 }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $securityContext | nindent 12 }}
          volumeMounts:
            {{- include "tandem.scratchMounts" $root | nindent 12 }}
            {{- if ne $model.source "image" }}
            - name: model
              mountPath: /models
              readOnly: true
            {{- end }}
      volumes:
        {{- include "tandem.scratchVolumes" $root | nindent 8 }}
        {{- if eq $model.source "pvc" }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ $model.claimName }}
            readOnly: true
        {{- else if eq $model.source "hostPath" }}
        - name: model
          hostPath:
            path: {{ $model.hostPath }}
            type: Directory
        {{- end }}
{{- include "tandem.pdb" . }}
{{- end }}
