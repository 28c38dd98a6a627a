{{/* Pod parts shared by the router and the workers. */}}

{{/* grpc.health.v1 probes: startup and readiness ask for the "" service (NOT_SERVING until the
process can serve: a router, until a worker of each role it needs is ready), liveness for
"tandem.liveness" (SERVING while the process answers, draining included): a router with a role
down is taken out of its Service, not restarted. With TLS they call the plaintext health-only port
(the kubelet's gRPC probes speak no TLS). (dict "root" $ "port" N) */}}
{{- define "tandem.probes" -}}
{{- $p := .root.Values.probes -}}
{{- $port := ternary $p.healthPort .port .root.Values.tls.enabled -}}
startupProbe:
  grpc:
    port: {{ int $port }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.startupFailureThreshold }}
readinessProbe:
  grpc:
    port: {{ int $port }}
  periodSeconds: {{ $p.periodSeconds }}
livenessProbe:
  grpc:
    port: {{ int $port }}
    service: tandem.liveness
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
{{- end }}

{{/* The container ports: grpc, and the health-only port under TLS. (dict "root" $ "port" N) */}}
{{- define "tandem.ports" -}}
- name: grpc
  containerPort: {{ int .port }}
{{- if .root.Values.tls.enabled }}
- name: health
  containerPort: {{ int .root.Values.probes.healthPort }}
{{- end }}
{{- end }}

{{/* TANDEM_ADMIN_TOKEN from the configured Secret, if any, and TANDEM_CLUSTER_TOKEN. (root context) */}}
{{- define "tandem.tokenEnv" -}}
{{- with .Values.adminToken.secretName }}
- name: TANDEM_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.adminToken.secretKey }}
{{- end }}
- name: TANDEM_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.clusterTokenSecret" . }}
      key: {{ .Values.clusterToken.secretKey }}
{{- end }}

{{/* TLS flags, the health-only port and the router's client-certificate policy. (dict "root" $ "router" bool) */}}
{{- define "tandem.tlsArgs" -}}
{{- $tls := .root.Values.tls }}
{{- if $tls.enabled }}
- --tls-cert=/etc/tandem/tls/tls.crt
- --tls-key=/etc/tandem/tls/tls.key
- --tls-ca=/etc/tandem/tls/ca.crt
{{- with $tls.serverName }}
- --tls-server-name={{ . }}
{{- end }}
{{- if .router }}
- --tls-client-auth={{ $tls.routerClientAuth }}
{{- end }}
- --health-port={{ int .root.Values.probes.healthPort }}
{{- end }}
{{- end }}

{{/* Writable scratch under a read-only root filesystem. */}}
{{- define "tandem.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSizeLimit }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "tandem.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Scheduling, security and image settings of a pod spec; the termination grace covers the
preStop hook (preStopSeconds), the drain and the exit.
(dict "root" $ "spec" <the component's values> "component" name "preStopSeconds" N) */}}
{{- define "tandem.podCommon" -}}
{{- $drain := .root.Values.drain -}}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ add (int .preStopSeconds) (int $drain.seconds) (int $drain.exitSeconds) }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $spread := .root.Values.topologySpread }}
{{- if .spec.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml .spec.topologySpreadConstraints | nindent 2 }}
{{- else if $spread.enabled }}
{{- /* The component's pods across nodes (and zones, when asked): one node's loss takes one replica. */}}
topologySpreadConstraints:
  {{- range $spread.topologyKeys }}
  - maxSkew: {{ int $spread.maxSkew }}
    topologyKey: {{ . }}
    whenUnsatisfiable: {{ $spread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "tandem.selectorLabels" (dict "root" $.root "component" $.component) | nindent 8 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* An optional PodDisruptionBudget for one component. (dict "root" $ "component" "x") */}}
{{- define "tandem.pdb" -}}
{{- if .root.Values.podDisruptionBudget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .root.Values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* Prometheus: the server flag, the pod annotations, the container and Service ports. (dict "root" $ "port" N) */}}
{{- define "tandem.metricsFlag" -}}
- --metrics-port={{ if .root.Values.metrics.enabled }}{{ int .port }}{{ else }}0{{ end }}
{{- end }}

{{- define "tandem.metricsAnnotations" -}}
{{- if .root.Values.metrics.enabled }}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ int .port | quote }}
  prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{- define "tandem.metricsContainerPort" -}}
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ int .port }}
{{- end }}
{{- end }}

{{- define "tandem.metricsServicePort" -}}
{{- if .root.Values.metrics.enabled }}
- name: metrics
  port: {{ int .port }}
  targetPort: metrics
{{- end }}
{{- end }}
