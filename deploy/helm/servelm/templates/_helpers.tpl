{{/* The chart's name (nameOverride replaces it). */}}
{{- define "servelm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object names: the release name, with the chart's name unless the release already holds it. */}}
{{- define "servelm.fullname" -}}
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

{{- define "servelm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "servelm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "servelm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "servelm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The image tag: the Dockerfile's target, cpu or cuda, unless image.tag names one. */}}
{{- define "servelm.image" -}}
{{- $tag := .Values.image.tag | default (ternary "cuda" "cpu" .Values.gpu.enabled) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/*
The pod's grace period, from the one drain setting: the preStop pause, then servelm's --drain-timeout
(running requests finish or are ended with an error), then the margin (uvicorn's 2 s flush of the cut
requests' error bodies and the process exit) before the kubelet's SIGKILL.
*/}}
{{- define "servelm.terminationGracePeriodSeconds" -}}
{{- add .Values.drain.preStopSleepSeconds .Values.drain.timeoutSeconds .Values.drain.marginSeconds }}
{{- end }}

{{- define "servelm.modelsClaim" -}}
{{- .Values.models.pvc.existingClaim | default (printf "%s-models" (include "servelm.fullname" .)) }}
{{- end }}
