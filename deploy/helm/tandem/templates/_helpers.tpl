{{/* Names are DNS labels: 63 characters at most. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
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

{{/* A component's name (router, prefill, ...). Cut to 44 so "-prefill" still leaves a StatefulSet
name whose controller-revision-hash label and pod names fit in 63. (dict "root" $ "component" "x") */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root | trunc 44 | trimSuffix "-") .component }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{ include "tandem.selectorLabels" . }}
{{- end }}

{{/* The Secret holding the cluster token: the configured one, or the one the chart creates. */}}
{{- define "tandem.clusterTokenSecret" -}}
{{- default (printf "%s-cluster-token" (include "tandem.fullname" .) | trunc 63 | trimSuffix "-") .Values.clusterToken.secretName }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag) }}
{{- end }}

{{/* --model for every worker: a path inside the image, or under the read-only /models volume. */}}
{{- define "tandem.modelPath" -}}
{{- $model := .Values.model }}
{{- if eq $model.source "image" }}
{{- $model.path }}
{{- else }}
{{- printf "/models/%s" $model.path | trimSuffix "/" }}
{{- end }}
{{- end }}

{{/* host:port of every worker pod through its headless Service, in role order. */}}
{{/* The router's --workers-dns: each worker role's headless Service, ROLE=NAME:PORT, for every
role with replicas (pods come and go behind it: `kubectl scale` needs no re-render). */}}
{{- define "tandem.workerServices" -}}
{{- $names := list }}
{{- range $role := list "prefill" "decode" "both" }}
{{- $spec := index $.Values $role }}
{{- if gt (int $spec.replicas) 0 }}
{{- $svc := include "tandem.componentName" (dict "root" $ "component" $role) }}
{{- $names = append $names (printf "%s=%s.%s.svc.%s:%d" $role $svc $.Release.Namespace $.Values.clusterDomain (int $spec.port)) }}
{{- end }}
{{- end }}
{{- join "," $names }}
{{- end }}

{{/* Whether the router finds its workers through DNS: router.discovery=dns, unless TLS is on
without tls.serverName (DNS answers pod IPs, which no certificate names). */}}
{{- define "tandem.dnsDiscovery" -}}
{{- if and (eq .Values.router.discovery "dns") (or (not .Values.tls.enabled) .Values.tls.serverName) }}true{{ end }}
{{- end }}

{{- define "tandem.workerAddresses" -}}
{{- $addresses := list }}
{{- range $role := list "prefill" "decode" "both" }}
{{- $spec := index $.Values $role }}
{{- $svc := include "tandem.componentName" (dict "root" $ "component" $role) }}
{{- range $i := until (int $spec.replicas) }}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc.%s:%d" $svc $i $svc $.Release.Namespace $.Values.clusterDomain (int $spec.port)) }}
{{- end }}
{{- end }}
{{- join "," $addresses }}
{{- end }}
