{{/* The chart's name ("dpukv", or nameOverride). */}}
{{- define "dpukv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object's name: the release name, plus the chart name unless it holds it. */}}
{{- define "dpukv.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "dpukv.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "chart-version" for the helm.sh/chart label. */}}
{{- define "dpukv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The labels of every object the chart makes (managed-by Helm: the operator's own children are
labelled managed-by dpukv-operator, which is how the monitors tell them apart). */}}
{{- define "dpukv.labels" -}}
helm.sh/chart: {{ include "dpukv.chart" . }}
{{ include "dpukv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dpukv
{{- end -}}

{{/* The labels that never change (selectors). */}}
{{- define "dpukv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dpukv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dpukv.operator.name" -}}
{{- printf "%s-operator" (include "dpukv.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dpukv.operator.selectorLabels" -}}
{{ include "dpukv.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "dpukv.devicePlugin.name" -}}
{{- printf "%s-device-plugin" (include "dpukv.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dpukv.devicePlugin.selectorLabels" -}}
{{ include "dpukv.selectorLabels" . }}
app.kubernetes.io/component: device-plugin
{{- end -}}

{{/* The operator's ServiceAccount. */}}
{{- define "dpukv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dpukv.operator.name" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image, "repository:tag" (tag: the chart's appVersion unless set). */}}
{{- define "dpukv.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The labels of the objects the operator makes for DpuKvClusters (operator/src/render.rs). */}}
{{- define "dpukv.clusterLabels" -}}
app.kubernetes.io/name: dpukv
app.kubernetes.io/managed-by: dpukv-operator
{{- end -}}

{{/* A restricted container securityContext: non-root, nothing to escalate to, no capabilities,
a read-only root file system, the runtime's default seccomp profile. */}}
{{- define "dpukv.restrictedContainerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The monitors' namespaceSelector for the clusters: serviceMonitor.namespaces, or any. */}}
{{- define "dpukv.clusterNamespaces" -}}
{{- with .Values.serviceMonitor.namespaces -}}
matchNames:
  {{- toYaml . | nindent 2 }}
{{- else -}}
any: true
{{- end -}}
{{- end -}}

{{/* A rules file of files/ (a YAML list of RBAC rules, which a generator may rewrite), as it is;
fails when it is missing or empty (a Role without rules would install and grant nothing). */}}
{{- define "dpukv.rules" -}}
{{- $root := index . 0 -}}
{{- $path := index . 1 -}}
{{- $rules := $root.Files.Get $path | trim -}}
{{- if not $rules -}}
{{- fail (printf "%s is missing or empty" $path) -}}
{{- end -}}
{{- $rules -}}
{{- end -}}
